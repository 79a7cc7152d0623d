"""The front-door table's rows, their ratios to Triton's own endpoints, the table and the targets."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.bench import cpu_share

KB = 1024
MB = 1024 * KB
NAN = float("nan")

TARGETS = (
    # (path, size or None for every size, minimum ratio to Triton's own endpoint of the same protocol)
    ("frontdoor-http", None, 1.0),
    ("frontdoor-grpc", None, 1.0),
    ("frontdoor-http", 16 * MB, 2.0),
)
"""The front door's throughput targets, in every cell (both servers, every caller count)."""


@dataclass
class Row:
    """One cell of the table (the median of its rounds)."""

    path: str
    server: str
    size: int
    callers: int
    mb_s: float
    p50_ms: float
    rounds: list[float] = field(default_factory=list)
    error: str | None = None
    ratio: float = NAN
    cpu_ms: dict[str, float] = field(default_factory=dict)
    """CPU milliseconds per call by process group (see :mod:`.cpu_share`)."""
    server_cpu_ms: float = NAN
    """CPU milliseconds per call of the processes serving the path (:func:`.frontdoor_perf.server_groups`)."""
    cpu_ratio: float = NAN
    """``server_cpu_ms`` over that of Triton's own endpoint of the same protocol."""
    calls: int = 0
    """Requests Triton counted during the cell's rounds (every path ends at it)."""
    failures: list[str] = field(default_factory=list)
    """The errors of the cell's rounds that failed (the row's numbers are those of the others)."""


def label(size: int) -> str:
    """``1 MB``, ``64 KB``: a payload size for the table."""
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def make_row(path: str, server: str, size: int, n: int, results: list[Any]) -> Row:
    """The row of a cell from its rounds' results (each with ``mb_s``, ``p50_ms``, ``calls``, ``error``)."""
    good = [r for r in results if r is not None and r.error is None and r.calls]
    errors = [r.error for r in results if r is not None and r.error]
    if not good:
        return Row(
            path, server, size, n, NAN, NAN, error=errors[0] if errors else "not available in this mode"
        )
    return Row(
        path,
        server,
        size,
        n,
        statistics.median(r.mb_s for r in good),
        statistics.median(r.p50_ms for r in good),
        rounds=[round(r.mb_s, 1) for r in good],
        failures=errors,
    )


def add_ratios(rows: list[Row]) -> None:
    """Each row's MB/s and server CPU per call over those of Triton's own endpoint of its protocol."""
    base = {(r.path, r.server, r.size, r.callers): r for r in rows}
    for row in rows:
        protocol = row.path.rsplit("-", 1)[1]
        triton = base.get((f"triton-{protocol}", row.server, row.size, row.callers))
        if triton is None:
            continue
        row.ratio = _over(row.mb_s, triton.mb_s)
        row.cpu_ratio = _over(row.server_cpu_ms, triton.server_cpu_ms)


def _over(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else NAN


def targets(rows: list[Row]) -> list[str]:
    """The targets' lines: met / NOT met, with the numbers of the cells that miss them."""
    lines = []
    for path, size, minimum in TARGETS:
        cells = [r for r in rows if r.path == path and (size is None or r.size == size)]
        if not cells:
            continue
        low = [r for r in cells if r.error or r.failures or not r.ratio >= minimum]
        where = f"{path}{' ' + label(size) if size else ''}, every cell >= {minimum:.1f}x Triton's own"
        lines.append(f"{where}: " + _verdict(cells, low, lambda r: f"{r.ratio:.2f}x"))
    ours = [r for r in rows if r.path.startswith("frontdoor-")]
    if ours and any(not math.isnan(r.server_cpu_ms) for r in ours):
        high = [r for r in ours if r.error or r.failures or not r.cpu_ratio <= 1.0]
        lines.append(
            "front door, server CPU per call <= Triton's own in every cell: "
            + _verdict(ours, high, lambda r: f"{r.server_cpu_ms:.2f} ms, {r.cpu_ratio:.2f}x")
        )
    return lines


def _verdict(cells: list[Row], missed: list[Row], value: Any) -> str:
    if not missed:
        return f"met ({len(cells)} cells)"
    return f"NOT met in {len(missed)} of {len(cells)} (" + ", ".join(_cell(r, value) for r in missed) + ")"


def _cell(row: Row, value: Any) -> str:
    where = f"{row.server} {row.path} {label(row.size)} x{row.callers}"
    if row.error:
        return f"{where} {row.error}"
    failed = f" and {len(row.failures)} round(s) FAILED" if row.failures else ""
    return f"{where} {value(row)}{failed}"


def table(rows: list[Row]) -> str:
    """The rows as a markdown table: MB/s, p50, ratio to Triton's own, server CPU per call."""
    with_groups = any(r.cpu_ms for r in rows)
    groups = " / ".join(cpu_share.GROUPS)
    lines = [
        "| server | path | payload | callers | MB/s | p50 ms | vs Triton's own | server CPU ms/call"
        " | vs Triton's own | rounds MB/s |" + (f" CPU ms/call: {groups} |" if with_groups else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_groups else ""),
    ]
    for r in rows:
        head = f"| {r.server} | {r.path} | {label(r.size)} | {r.callers} |"
        if r.error:
            lines.append(f"{head} - | - | - | - | - | {r.error} |" + (" - |" if with_groups else ""))
            continue
        lines.append(
            f"{head} {r.mb_s:.0f} | {r.p50_ms:.1f} | {r.ratio:.2f}x | {_num(r.server_cpu_ms)}"
            f" | {_num(r.cpu_ratio, 'x')} | {', '.join(str(x) for x in r.rounds)}{_failed(r)} |"
            + (
                f" {' / '.join(f'{r.cpu_ms.get(g, NAN):.2f}' for g in cpu_share.GROUPS)} |"
                if with_groups
                else ""
            )
        )
    return "\n".join(lines)


def _failed(row: Row) -> str:
    return "".join(f"; a round FAILED: {e.replace('|', '/')[:160]}" for e in row.failures)


def _num(value: float, unit: str = "") -> str:
    return "-" if math.isnan(value) else f"{value:.2f}{unit}"
