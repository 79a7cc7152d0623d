"""Timing cells: one method at one payload size and caller count, in rounds that rotate the methods."""

from __future__ import annotations

import gc
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ray_triton_shm._private.bench.options import KB, MB, BenchOptions, Record
from ray_triton_shm._private.bench.servers import BenchServer
from ray_triton_shm._private.bench.timing import CellTiming, Progress, run_callers

logger = logging.getLogger(__name__)


def label(size: int) -> str:
    """``4 KB``, ``16 MB``: a payload size for people."""
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def record_from(method: str, size: int, concurrency: int, timing: Any, paths: set[str], group: str) -> Record:
    """The record of ``method``'s cell measured as ``timing`` (over the paths it took)."""
    wall_mb_s = timing.calls * size / timing.elapsed_s / 1e6
    return Record(
        method=method,
        payload_bytes=size,
        concurrency=concurrency,
        # One caller: payload / median latency, which shrugs off stalls caused by
        # other load on the machine. Several: total bytes / wall time, since a
        # per-call median would hide the time callers wait for each other
        # (the GIL, the server's queue) between their timed calls.
        throughput_mb_s=(size / (timing.percentile_ms(50) / 1e3) / 1e6 if concurrency == 1 else wall_mb_s),
        p50_ms=timing.percentile_ms(50),
        p99_ms=timing.percentile_ms(99),
        calls=timing.calls,
        ok=True,
        group=group,
        path="/".join(sorted(paths)),
        extra={"wall_mb_s": round(wall_mb_s, 2)},
    )


def failed(method: str, size: int, concurrency: int, error: BaseException, group: str) -> Record:
    """The record of a cell that failed with ``error`` (logged)."""
    logger.error("%s %s x%d failed: %s", method, label(size), concurrency, error)
    nan = float("nan")
    return Record(
        method, size, concurrency, nan, nan, nan, 0, False, group, error=f"{type(error).__name__}: {error}"
    )


def time_cell(
    open_cell: Callable[[], Any], calls: int, budget_s: float, warmup: int, settle_s: float = 0.0
) -> tuple[CellTiming, set[str], dict[str, float]]:
    """Open a cell, time its callers and close it; the timing, the paths taken, the cell's extra figures."""
    cell = None
    try:
        cell = open_cell()
        timing = run_callers(
            cell.callers, warmup=warmup, min_calls=calls, budget_s=budget_s, settle_s=settle_s
        )
        return timing, cell.paths, dict(cell.extra)
    finally:
        if cell is not None:
            cell.close()
        gc.collect()


def run_group(
    openers: Sequence[tuple[str, Callable[[], Any]]],
    size: int,
    concurrency: int,
    options: BenchOptions,
    group: str,
    progress: Progress,
) -> list[Record]:
    """The cells of one payload size and caller count, every method, in ``options.rounds`` rounds.

    Returns:
        One record per method, in the order of ``openers``; a method that failed
        in any round gets a failed record.
    """
    rounds = options.rounds or 1
    per_caller = max(2, -(-(options.min_calls or 1) // concurrency))
    calls = max(1, -(-per_caller // rounds))
    budget_s = (options.budget_s or 1.0) / rounds
    # A lone caller gets one more warm-up call: the first large request grows
    # the server's Python-backend arena, which is not what we want to time.
    warmup = options.warmup + (1 if concurrency == 1 else 0)
    timings: dict[str, list[CellTiming]] = {method: [] for method, _ in openers}
    paths: dict[str, set[str]] = {method: set() for method, _ in openers}
    extras: dict[str, list[dict[str, float]]] = {method: [] for method, _ in openers}
    errors: dict[str, BaseException] = {}
    for index in range(rounds):
        shift = index % len(openers)
        for method, open_cell in [*openers[shift:], *openers[:shift]]:
            progress.step(
                f"{method} {label(size)} x{concurrency}" + (f" ({index + 1}/{rounds})" if rounds > 1 else "")
            )
            if method not in errors:
                try:
                    timing, cell_paths, cell_extra = time_cell(
                        open_cell, calls, budget_s, warmup, options.settle_s or 0.0
                    )
                    timings[method].append(timing)
                    paths[method] |= cell_paths
                    extras[method].append(cell_extra)
                except Exception as e:
                    errors[method] = e
            progress.advance()
    records = []
    for method, _ in openers:
        if method in errors:
            records.append(failed(method, size, concurrency, errors[method], group))
        else:
            merged = CellTiming.merged(timings[method])
            record = record_from(method, size, concurrency, merged, paths[method], group)
            for key in sorted({k for extra in extras[method] for k in extra}):
                # a figure a cell measured besides its calls: the median over the rounds
                record.extra[key] = round(statistics.median(e[key] for e in extras[method] if key in e), 3)
            if rounds > 1:  # the spread between rounds says how far one cell can be trusted
                record.extra["mb_s_by_round"] = [
                    round(record_from(method, size, concurrency, t, set(), group).throughput_mb_s, 2)
                    for t in timings[method]
                ]
            records.append(record)
    return records


def tagged(records: list[Record], server: BenchServer) -> list[Record]:
    """``records``, each marked as measured on ``server``."""
    for record in records:
        record.server = server.name
    return records
