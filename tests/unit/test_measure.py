from __future__ import annotations

import time

import pytest

from ray_triton_shm._private.bench.measure import Timing, time_call


def test_percentiles() -> None:
    timing = Timing(seconds=(0.005, 0.001, 0.003, 0.002, 0.004), payload_bytes=0)
    assert timing.percentile_ms(0) == pytest.approx(1.0)
    assert timing.percentile_ms(50) == pytest.approx(3.0)
    assert timing.percentile_ms(100) == pytest.approx(5.0)
    assert timing.percentile_ms(75) == pytest.approx(4.0)
    # Out-of-range q is clamped, not an IndexError.
    assert timing.percentile_ms(150) == pytest.approx(5.0)
    assert timing.percentile_ms(-10) == pytest.approx(1.0)


def test_percentile_of_one() -> None:
    timing = Timing(seconds=(0.25,), payload_bytes=10)
    for q in (0, 50, 99, 100):
        assert timing.percentile_ms(q) == pytest.approx(250.0)


def test_median_and_throughput() -> None:
    timing = Timing(seconds=(0.5, 0.1, 0.2, 0.3), payload_bytes=2_000_000)
    assert timing.median_s == pytest.approx(0.25)
    assert timing.mb_per_s == pytest.approx(2.0 / 0.25)


def test_time_call_counts_warmup_and_repeats() -> None:
    calls = []
    timing = time_call(lambda: calls.append(1), 123, warmup=3, repeats=4)
    assert len(calls) == 7
    assert len(timing.seconds) == 4
    assert timing.payload_bytes == 123
    assert all(s >= 0 for s in timing.seconds)


def test_time_call_measures_the_call() -> None:
    timing = time_call(lambda: time.sleep(0.02), 1, warmup=0, repeats=2)
    assert len(timing.seconds) == 2
    assert all(0.019 <= s < 0.5 for s in timing.seconds)


def test_time_call_stops_at_budget() -> None:
    calls = []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.03)

    timing = time_call(slow, 1, warmup=1, repeats=1000, budget_s=0.05)
    assert 1 <= len(timing.seconds) <= 3
    assert len(calls) == 1 + len(timing.seconds)
