"""The node actor's reaper covers Triton from its launch: an actor killed while models load leaves nothing
(no process, no Python-backend directory)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ray_triton_shm._private.triton.process import python_env_dirs

pytestmark = pytest.mark.slow

LOAD_S = 120  # longer than the test: the actor dies while its model is still loading

_SLOW_MODEL = f"""
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({LOAD_S})

    def execute(self, requests):
        raise NotImplementedError
"""
_SLOW_CONFIG = """
name: "slow_load"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _pids_with(text: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _group(pgid: int) -> list[int]:
    """Live members of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _stubs(pgid: int) -> list[int]:
    """The Python-backend stubs (of ``slow_load``) in process group ``pgid``."""
    stubs = []
    for pid in _group(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmdline and b"slow_load" in cmdline:
            stubs.append(pid)
    return stubs


def _wait(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def test_an_actor_killed_while_its_models_load_leaves_no_triton_behind(ray_local, tmp_path: Path) -> None:
    import ray

    from ray_triton_shm import ServerConfig
    from ray_triton_shm.node import NodeConfig, TritonNodeActor

    model = tmp_path / "slow" / "slow_load"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(_SLOW_MODEL)
    (model / "config.pbtxt").write_text(_SLOW_CONFIG)
    repository = str(model.parent)
    server = ServerConfig(
        model_repository=repository, load_models=("slow_load",), startup_timeout_s=LOAD_S * 2
    )
    before = python_env_dirs()
    actor = TritonNodeActor.options(max_restarts=0).remote(NodeConfig(server=server, idle_shutdown_s=None))
    leader = 0
    try:
        # Triton's leader names the repository on its command line; its stub joins its group.
        leaders = _wait(lambda: _pids_with(f"--model-repository={repository}".encode()), 120)
        assert leaders, "Triton did not start"
        leader = leaders[0]
        assert _wait(lambda: _stubs(leader), 60), "the model's backend stub did not start"
        # Its backend made its directory before the stub started; launches take turns until theirs
        # appear, so one new directory is this server's (two: another test's too, not judged).
        made = python_env_dirs() - before
        assert made, "the Python backend made no directory"
        ours = made.pop() if len(made) == 1 else None
        time.sleep(0.5)  # the starting actor looks for it every 0.1 s or so, then tells its reaper
        fields = _stat(leader)
        assert fields is not None
        actor_pid = int(fields[1])  # the actor launched it
        os.kill(actor_pid, signal.SIGKILL)  # while the model still loads
        # The reaper acts within a second or so of the actor's death.
        left = _wait(lambda: not _group(leader), 8) or _group(leader)
        assert left is True, f"Triton's processes {left} outlived the actor killed while its models loaded"
        if ours is not None:  # the actor told its reaper as soon as the backend made it
            assert _wait(lambda: not os.path.exists(ours), 8), f"{ours} outlived the actor"
    finally:
        for pid in _group(leader) if leader else []:
            os.kill(pid, signal.SIGKILL)
        ray.kill(actor, no_restart=True)
