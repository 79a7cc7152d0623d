"""Copy the latest benchmark run into docs/benchmarks.md (``make bench-docs``).

The report of ``bench-results/`` replaces the text between the
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers, and the plots are
copied to ``docs/img/bench-*.png``; the front-door table (``frontdoor.md``, from
``bench --frontdoor``), when the run has one, replaces the text between the
``<!-- frontdoor:begin -->`` and ``<!-- frontdoor:end -->`` markers.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
FRONTDOOR_BEGIN = "<!-- frontdoor:begin -->"
FRONTDOOR_END = "<!-- frontdoor:end -->"


def update_docs(results_dir: str = "bench-results", docs_file: str = "docs/benchmarks.md") -> None:
    """Paste ``results_dir/report.md`` (and ``frontdoor.md``) into ``docs_file``, its plots next to it.

    Raises:
        FileNotFoundError: No report in ``results_dir``.
        ValueError: ``docs_file`` lacks the markers (the front door's, when there is a front-door table).
    """
    results, docs = Path(results_dir), Path(docs_file)
    report = (results / "report.md").read_text()
    images = docs.parent / "img"
    images.mkdir(parents=True, exist_ok=True)
    for png in sorted(results.glob("*.png")):
        shutil.copyfile(png, images / f"bench-{png.name}")
        report = report.replace(f"({png.name})", f"(img/bench-{png.name})")
    text = _paste(docs.read_text(), BEGIN, END, _demoted(report), docs)
    frontdoor = results / "frontdoor.md"
    if frontdoor.is_file():
        text = _paste(text, FRONTDOOR_BEGIN, FRONTDOOR_END, _demoted(frontdoor.read_text()), docs)
    docs.write_text(text)


def _demoted(report: str) -> str:
    return re.sub(r"^## ", "### ", report, flags=re.MULTILINE)


def _paste(text: str, begin: str, end: str, block: str, docs: Path) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"{docs} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"
