"""Copy the latest benchmark run into docs/benchmarks.md (``make bench-docs``).

The report of ``bench-results/`` replaces the text between the
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers, and the plots are
copied to ``docs/img/bench-*.png``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"


def update_docs(results_dir: str = "bench-results", docs_file: str = "docs/benchmarks.md") -> None:
    """Paste ``results_dir/report.md`` into ``docs_file`` and copy its plots next to it.

    Raises:
        FileNotFoundError: No report in ``results_dir``.
        ValueError: ``docs_file`` lacks the markers.
    """
    results, docs = Path(results_dir), Path(docs_file)
    report = (results / "report.md").read_text()
    images = docs.parent / "img"
    images.mkdir(parents=True, exist_ok=True)
    for png in sorted(results.glob("*.png")):
        shutil.copyfile(png, images / f"bench-{png.name}")
        report = report.replace(f"({png.name})", f"(img/bench-{png.name})")
    report = re.sub(r"^## ", "### ", report, flags=re.MULTILINE)
    text = docs.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{docs} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    docs.write_text(f"{head}{BEGIN}\n{report}\n{END}{tail}")
