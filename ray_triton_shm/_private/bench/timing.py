"""Running one benchmark cell: N callers, warm-up, a time budget, latencies and throughput."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CellTiming:
    """What one cell measured.

    Attributes:
        latencies_s: Every timed call's wall time, all callers together.
        elapsed_s: Wall time from the common start to the last caller's end.
        calls: Timed calls completed.
    """

    latencies_s: tuple[float, ...]
    elapsed_s: float
    calls: int

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in ms."""
        ordered = sorted(self.latencies_s)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1] * 1e3

    @classmethod
    def merged(cls, parts: Sequence[CellTiming]) -> CellTiming:
        """One timing of several rounds of a cell: their calls and wall times added up."""
        return cls(
            tuple(x for part in parts for x in part.latencies_s),
            sum(part.elapsed_s for part in parts),
            sum(part.calls for part in parts),
        )


def run_callers(
    callers: Sequence[Callable[[bool], object]],
    *,
    warmup: int,
    min_calls: int,
    budget_s: float,
    max_calls: int = 10_000,
) -> CellTiming:
    """Run every caller in its own thread, check outputs during warm-up, time the rest.

    Each caller is called as ``caller(check)``; with ``check=True`` it must verify
    its output and raise if it is wrong. Warm-up calls (and one call after timing)
    are checked; timed calls are not, so checks cost nothing in the numbers.

    Args:
        callers: One per concurrent caller.
        warmup: Checked calls per caller before timing.
        min_calls: Timed calls each caller makes at least.
        budget_s: After this long, callers stop once they have ``min_calls``.
        max_calls: Upper bound of timed calls per caller.

    Returns:
        The timings.

    Raises:
        Exception: The first error of any caller (outputs wrong, server errors).
    """
    count = len(callers)
    t0 = [0.0]
    # The barrier's action stamps the common start before any caller is released.
    start = threading.Barrier(count + 1, action=lambda: t0.__setitem__(0, time.perf_counter()))
    latencies: list[list[float]] = [[] for _ in range(count)]
    ends = [0.0] * count
    errors: list[BaseException] = []

    def body(index: int) -> None:
        call = callers[index]
        mine = latencies[index]
        try:
            for _ in range(warmup):
                call(True)
        except BaseException as e:
            errors.append(e)
        start.wait()
        if errors:
            return
        try:
            deadline = t0[0] + budget_s
            while len(mine) < max_calls:
                began = time.perf_counter()
                call(False)
                now = time.perf_counter()
                mine.append(now - began)
                if len(mine) >= min_calls and now >= deadline:
                    break
            ends[index] = time.perf_counter()
            call(True)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    flat = tuple(x for per in latencies for x in per)
    return CellTiming(flat, max(ends) - t0[0], len(flat))


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, *, enabled: bool = True, width: int = 28) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled and total > 0
        self.width = width
        self._began = time.monotonic()

    def step(self, label: str) -> None:
        """Show ``label`` as the item now running."""
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self._began
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label[:60]:<60}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            self.step("done")
            sys.stderr.write("\n")
            sys.stderr.flush()
