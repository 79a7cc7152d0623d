"""tests/lanes.py splits the suite into its tiers: what make test and make test-slow run."""

from __future__ import annotations

import pytest

from tests import lanes


def _by_name(tier: str) -> dict[str, lanes.Job]:
    return {job.name: job for job in lanes.jobs(tier=tier)}


def test_the_tiers_together_run_every_job_and_split_the_marked_ones() -> None:
    every = _by_name("all")
    fast, slow = _by_name("fast"), _by_name("slow")
    assert set(fast) | set(slow) == set(every)
    for name, job in every.items():
        assert "-m" not in job.args, name
        text = "".join(p.read_text() for p in lanes.REPO.glob(name) if p.is_file())
        if name in fast and name in slow:  # some of its tests are marked slow: each tier runs its own
            assert fast[name].args[-2:] == ["-m", "not slow"] and fast[name].key == f"{name} (fast)"
            assert slow[name].args[-2:] == ["-m", "slow"] and slow[name].key == f"{name} (slow)"
        elif name in slow:  # a module marked slow as a whole runs whole, and only there
            assert slow[name].args == job.args and slow[name].key == name
            if text:
                assert "pytestmark" in text and "mark.slow" in text, name
        else:
            assert fast[name].args == job.args and "mark.slow" not in text, name


def test_a_module_marked_slow_as_a_whole_is_not_in_make_test() -> None:
    fast, slow = _by_name("fast"), _by_name("slow")
    smoke = "tests/integration/on_ray/test_bench_smoke.py"
    assert smoke in slow and smoke not in fast
    # The front door's own scenarios are in make test.
    for module in ("test_serve_citizen.py", "test_attacks.py", "test_real_peers.py", "test_perf_analyzer.py"):
        assert f"tests/integration/on_ray/{module}" in fast


def test_an_unknown_tier_or_job_is_refused() -> None:
    with pytest.raises(ValueError, match="no such tier"):
        lanes.jobs(tier="quick")
    with pytest.raises(SystemExit, match="no such job"):
        lanes.jobs(["tests/integration/on_ray/test_nothing.py"])
    # A job named that the tier has none of: no job, no error.
    assert lanes.jobs(["tests/integration/on_ray/test_bench_smoke.py"], tier="fast") == []


def test_a_failed_jobs_summary_says_why_in_a_few_lines() -> None:
    output = "\n".join(
        [
            "tests/x.py EEF",
            "E   assert 1 == 2",
            "=========================== short test summary info ============================",
            "ERROR tests/x.py::test_a - RuntimeError: Failed to start the GCS",
            "FAILED tests/x.py::test_c - assert 1 == 2" + "x" * 1000,
            "========================= 1 failed, 2 errors in 3.00s ==========================",
        ]
    )
    why = lanes.failure_lines(output)
    assert why[0] == "ERROR tests/x.py::test_a - RuntimeError: Failed to start the GCS"
    assert why[1].startswith("FAILED tests/x.py::test_c") and len(why[1]) == lanes.WHY_WIDTH
    assert len(why) == 2


def test_a_crash_is_summed_up_by_its_fatal_error_or_the_last_lines() -> None:
    crash = "..\nFatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n  File x\n"
    assert lanes.failure_lines(crash) == ["Fatal Python error: Segmentation fault"]
    killed = "\n".join(f"line {n}" for n in range(20)) + "\n\n"
    assert lanes.failure_lines(killed) == [f"line {n}" for n in range(15, 20)]
    many = "\n".join(f"FAILED tests/x.py::test_{n}" for n in range(30))
    why = lanes.failure_lines(many)
    assert len(why) == lanes.WHY_LINES and why[-1] == f"... and {30 - lanes.WHY_LINES + 1} more"
