"""The benchmark's rounds: methods take turns, timings add up, a failure stays with its method."""

from __future__ import annotations

import pytest

from ray_triton_shm._private.bench import timing
from ray_triton_shm._private.bench.cells import run_group
from ray_triton_shm._private.bench.core_methods import Cell
from ray_triton_shm._private.bench.options import BenchOptions
from ray_triton_shm._private.bench.timing import CellTiming, Progress


def test_merged_timing_adds_calls_and_wall_time() -> None:
    merged = CellTiming.merged([CellTiming((0.1, 0.3), 1.0, 2), CellTiming((0.2,), 0.5, 1)])
    assert merged == CellTiming((0.1, 0.3, 0.2), 1.5, 3)
    assert merged.percentile_ms(50) == pytest.approx(200.0)


def _options(rounds: int) -> BenchOptions:
    return BenchOptions(rounds=rounds, budget_s=1e-6, min_calls=1, warmup=1, progress=False)


def test_every_method_runs_once_per_round_in_a_rotating_order() -> None:
    opened: list[str] = []
    closed: list[str] = []

    def opener(name: str):
        def open_cell() -> Cell:
            opened.append(name)
            return Cell([lambda check: None, lambda check: None], [lambda: closed.append(name)], {name})

        return open_cell

    openers = [(name, opener(name)) for name in ("a", "b", "c")]
    progress = Progress(9, enabled=False)
    records = run_group(openers, 4096, 2, _options(3), "core", progress)

    assert opened == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert sorted(closed) == sorted(opened)
    assert progress.done == 9
    assert [r.method for r in records] == ["a", "b", "c"]
    for record in records:
        assert record.ok and record.path == record.method
        # Two callers, each at least 2 timed calls (min_calls spread over rounds: 1 per round), 3 rounds.
        assert record.calls == 2 * 3
        assert record.throughput_mb_s > 0
        assert len(record.extra["mb_s_by_round"]) == 3 and all(r > 0 for r in record.extra["mb_s_by_round"])


def test_a_method_that_fails_is_recorded_failed_and_skipped_afterwards() -> None:
    attempts = {"good": 0, "bad": 0}

    def good() -> Cell:
        attempts["good"] += 1
        return Cell([lambda check: None])

    def bad() -> Cell:
        attempts["bad"] += 1

        def call(check: bool) -> None:
            raise RuntimeError("wrong output")

        return Cell([call])

    progress = Progress(4, enabled=False)
    records = run_group([("good", good), ("bad", bad)], 1024, 1, _options(2), "core", progress)
    assert attempts == {"good": 2, "bad": 1}
    good_record, bad_record = records
    assert good_record.ok and good_record.calls >= 2
    assert not bad_record.ok and "wrong output" in (bad_record.error or "")


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds"):
        BenchOptions(rounds=0)
    assert BenchOptions(quick=True).resolved().rounds == 1
    assert BenchOptions().resolved().rounds == 3


def test_a_cells_extra_figures_reach_its_record_as_the_median_over_rounds() -> None:
    figures = iter([3.0, 1.0, 2.0])

    def open_cell() -> Cell:
        return Cell([lambda check: None], extra={"handle_floor_p50_ms": next(figures)})

    progress = Progress(3, enabled=False)
    (record,) = run_group([("a", open_cell)], 4096, 1, _options(3), "serve", progress)
    assert record.extra["handle_floor_p50_ms"] == 2.0


def test_settle_waits_for_idle_cpus_and_no_longer_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # (busy, total) ticks: 90 % busy for two windows, then 10 %.
    ticks = iter([(0, 0), (90, 100), (180, 200), (190, 300), (200, 400)])
    monkeypatch.setattr(timing, "_cpu_ticks", lambda: next(ticks))
    waited = timing.settle(window_s=0.01, max_wait_s=5.0)
    assert 0.025 <= waited < 1.0
    assert next(ticks) == (200, 400)  # stopped at the first idle window

    always_busy = iter((100 * i, 100 * i) for i in range(10_000))
    monkeypatch.setattr(timing, "_cpu_ticks", lambda: next(always_busy))
    waited = timing.settle(window_s=0.01, max_wait_s=0.2)
    assert 0.2 <= waited < 1.0


def test_callers_settle_after_warm_up_before_the_timed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(timing, "settle", lambda max_wait_s: events.append(f"settle {max_wait_s}") or 0.0)

    def caller(check: bool) -> None:
        events.append("warm-up" if check and "settle 0.5" not in events else "call")

    timing.run_callers([caller, caller], warmup=1, min_calls=1, budget_s=0.0, settle_s=0.5)
    assert events[:3] == ["warm-up", "warm-up", "settle 0.5"]
    assert events.count("settle 0.5") == 1 and "warm-up" not in events[3:]

    events.clear()
    timing.run_callers([caller], warmup=1, min_calls=1, budget_s=0.0)
    assert not any(e.startswith("settle") for e in events)
