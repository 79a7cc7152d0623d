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


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot; None where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def settle(*, busy_below: float = 0.25, window_s: float = 0.1, max_wait_s: float = 1.0) -> float:
    """Wait until the machine's CPUs are mostly idle (at most ``max_wait_s``); the seconds waited.

    The cell before may leave work behind that is not its own timing's (Ray
    freeing its objects, a replica collecting garbage, a backend stub's
    arenas): on 2 cores that work lands in the next cell's numbers, whichever
    method it is. Every cell waits the same way before its timed calls.
    """
    began = time.monotonic()
    last = _cpu_ticks()
    if last is None:
        return 0.0
    while time.monotonic() - began < max_wait_s:
        time.sleep(window_s)
        now = _cpu_ticks()
        if now is None:
            break
        busy, total = now[0] - last[0], now[1] - last[1]
        last = now
        if total > 0 and busy / total < busy_below:
            break
    return time.monotonic() - began


def run_callers(
    callers: Sequence[Callable[[bool], object]],
    *,
    warmup: int,
    min_calls: int,
    budget_s: float,
    max_calls: int = 10_000,
    settle_s: float = 0.0,
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
        settle_s: After the warm-up, wait up to this long for the machine to go
            idle before the timed calls (see :func:`settle`; 0: no wait).

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
    if settle_s > 0:
        while start.n_waiting < count and any(t.is_alive() for t in threads):
            time.sleep(0.005)  # every caller has warmed up (or failed)
        if not errors:
            settle(max_wait_s=settle_s)
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
