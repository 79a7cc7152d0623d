"""The front-door table: server CPU per call by path, ratios to Triton's own, the targets' verdicts."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from ray_triton_shm._private.bench import cpu_share
from ray_triton_shm._private.bench.frontdoor_perf import server_cpu_ms, server_groups
from ray_triton_shm._private.bench.frontdoor_table import MB, Row, add_ratios, table, targets


def test_each_path_counts_the_processes_that_serve_it() -> None:
    assert server_groups("frontdoor-grpc") == ("replicas", "triton")
    assert server_groups("triton-http") == ("triton",)
    assert server_groups("serve-http") == ("proxy", "replicas", "triton")
    with pytest.raises(ValueError, match="unknown path"):
        server_groups("nginx-http")


def test_server_cpu_per_call_leaves_out_the_callers_and_the_rest() -> None:
    spent = {"callers": 9.0, "replicas": 0.25, "proxy": 0.5, "triton": 0.125, "rest": 7.0}
    assert server_cpu_ms("frontdoor-http", spent, 100) == pytest.approx(3.75)
    assert server_cpu_ms("triton-grpc", spent, 100) == pytest.approx(1.25)
    assert server_cpu_ms("serve-grpc", spent, 100) == pytest.approx(8.75)
    assert math.isnan(server_cpu_ms("triton-grpc", spent, 0))


def test_proxies_and_perf_analyzer_have_groups_of_their_own() -> None:
    assert cpu_share.group_of(5, "ray::ProxyActor", ()) == "proxy"
    assert cpu_share.group_of(6, "haproxy -f /tmp/hp/haproxy.cfg", ()) == "proxy"
    assert cpu_share.group_of(7, "perf_analyzer /x/perf_analyzer -m identity", ()) == "callers"


def test_descendants_follow_parents_down_from_the_root_only() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20}
    assert cpu_share.descendants(10, parents) == {10, 11, 12}
    assert cpu_share.descendants(12, parents) == {12}


def test_a_rooted_snapshot_holds_this_process_and_its_children_only() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = cpu_share.snapshot(os.getpid())
        assert os.getpid() in mine and child.pid in mine
        assert 1 not in mine and os.getppid() not in mine
    finally:
        child.kill()
        child.wait()


def _row(path: str, mb_s: float, cpu: float, size: int = MB, server: str = "native") -> Row:
    return Row(path, server, size, 8, mb_s, 1.0, server_cpu_ms=cpu)


def test_ratios_are_to_triton_own_endpoint_of_the_same_protocol_server_size_and_callers() -> None:
    rows = [
        _row("frontdoor-http", 300.0, 1.0),
        _row("triton-http", 200.0, 2.0),
        _row("frontdoor-grpc", 150.0, 3.0),
        _row("triton-grpc", 300.0, 1.5),
        _row("frontdoor-http", 100.0, 1.0, server="python"),  # no Triton row for it
    ]
    add_ratios(rows)
    assert rows[0].ratio == pytest.approx(1.5) and rows[0].cpu_ratio == pytest.approx(0.5)
    assert rows[2].ratio == pytest.approx(0.5) and rows[2].cpu_ratio == pytest.approx(2.0)
    assert rows[1].ratio == 1.0 and rows[1].cpu_ratio == 1.0
    assert math.isnan(rows[4].ratio) and math.isnan(rows[4].cpu_ratio)


def test_targets_name_the_cells_that_miss_them() -> None:
    rows = [
        _row("frontdoor-http", 500.0, 1.0, 16 * MB),
        _row("triton-http", 200.0, 2.0, 16 * MB),
        _row("frontdoor-grpc", 270.0, 3.0),
        _row("triton-grpc", 300.0, 1.5),
    ]
    add_ratios(rows)
    lines = targets(rows)
    assert lines[0] == "frontdoor-http, every cell >= 1.0x Triton's own: met (1 cells)"
    assert lines[1].startswith("frontdoor-grpc, every cell >= 1.0x Triton's own: NOT met in 1 of 1")
    assert "native frontdoor-grpc 1 MB x8 0.90x" in lines[1]
    assert lines[2] == "frontdoor-http 16 MB, every cell >= 2.0x Triton's own: met (1 cells)"
    assert "NOT met in 1 of 2" in lines[3] and "3.00 ms, 2.00x" in lines[3]


def test_a_failed_cell_misses_its_target_and_shows_in_the_table() -> None:
    rows = [_row("frontdoor-grpc", math.nan, math.nan), _row("triton-grpc", 300.0, 1.5)]
    rows[0].error = "perf_analyzer exited with 99"
    add_ratios(rows)
    assert "NOT met" in targets(rows)[0] and "exited with 99" in targets(rows)[0]
    text = table(rows)
    assert "| native | frontdoor-grpc | 1 MB | 8 | - |" in text
    assert "| native | triton-grpc | 1 MB | 8 | 300 | 1.0 | 1.00x | 1.50 | 1.00x |" in text


def test_a_round_that_failed_stays_in_the_row_and_misses_the_target() -> None:
    from types import SimpleNamespace

    from ray_triton_shm._private.bench.frontdoor_table import make_row

    good = SimpleNamespace(mb_s=200.0, p50_ms=5.0, calls=10, error=None)
    bad = SimpleNamespace(
        mb_s=math.nan, p50_ms=math.nan, calls=0, error="Thread [3] had error: Stream removed"
    )
    row = make_row("frontdoor-grpc", "native", MB, 8, [bad, good])
    assert row.mb_s == 200.0 and row.rounds == [200.0] and row.failures == [bad.error]
    rows = [row, _row("triton-grpc", 100.0, 1.5)]
    add_ratios(rows)
    assert "round(s) FAILED" in targets(rows)[0]
    assert "a round FAILED: Thread [3] had error: Stream removed" in table(rows)
