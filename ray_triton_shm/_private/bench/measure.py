"""Timing helpers shared by the demo and the benchmark."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call.

    Attributes:
        seconds: Each repetition's wall time.
        payload_bytes: Bytes of input moved per call.
    """

    seconds: tuple[float, ...]
    payload_bytes: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / self.median_s / 1e6

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.seconds)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index] * 1e3


def time_call(
    call: Callable[[], object],
    payload_bytes: int,
    *,
    warmup: int = 2,
    repeats: int = 5,
    budget_s: float = 10.0,
) -> Timing:
    """Time ``call`` after ``warmup`` runs, ``repeats`` times or until ``budget_s`` is spent.

    Returns:
        The timings (at least one repetition).
    """
    for _ in range(warmup):
        call()
    seconds = []
    started = time.perf_counter()
    while len(seconds) < repeats:
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
        if time.perf_counter() - started > budget_s:
            break
    return Timing(tuple(seconds), payload_bytes)
