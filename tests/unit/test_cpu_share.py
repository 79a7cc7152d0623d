"""CPU time by process group, as the front-door benchmark reports it."""

from __future__ import annotations

import os
import time

from ray_triton_shm._private.bench import cpu_share


def test_groups_by_caller_pid_and_command_line() -> None:
    callers = {10, 11}
    assert cpu_share.group_of(10, "python -c spawn_main", callers) == "callers"
    assert (
        cpu_share.group_of(12, "ray::ServeReplica:triton:TritonDeployment ray::ServeReplica", callers)
        == "replicas"
    )
    assert (
        cpu_share.group_of(13, "tritonserver /venv/bin/tritonserver --model-repository=x", callers)
        == "triton"
    )
    assert (
        cpu_share.group_of(14, "triton_python_backend_stub /models/identity/1/model.py", callers) == "triton"
    )
    assert cpu_share.group_of(15, "raylet /venv/bin/raylet", callers) == "rest"


def test_cpu_by_group_counts_the_difference_and_new_processes_whole() -> None:
    before = {1: (2.0, "caller"), 2: (5.0, "ray::ServeReplica"), 3: (1.0, "raylet")}
    after = {
        1: (2.5, "caller"),
        2: (5.25, "ray::ServeReplica"),
        3: (1.0, "raylet"),
        4: (0.125, "tritonserver"),
    }
    assert cpu_share.cpu_by_group(before, after, {1}) == {
        "callers": 0.5,
        "replicas": 0.25,
        "proxy": 0.0,
        "triton": 0.125,
        "rest": 0.0,
    }


def test_snapshot_sees_this_process_spend_cpu() -> None:
    first = cpu_share.snapshot()[os.getpid()]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    second = cpu_share.snapshot()[os.getpid()]
    assert second[0] - first[0] >= 0.2
    assert "python" in second[1] or "pytest" in second[1]
