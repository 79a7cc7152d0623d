"""The server's process group: its Python-backend stubs go with it, however the server ended."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ray_triton_shm import ServerConfig, TritonServer
from tests.helpers import wait_for

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "deployments" / "models"


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


@pytest.fixture
def python_model_repository(tmp_path: Path) -> str:
    """``identity`` (Python backend, two instances: two stubs)."""
    model = tmp_path / "models" / "identity"
    (model / "1").mkdir(parents=True)
    source = MODEL_REPOSITORY / "identity"
    (model / "1" / "model.py").write_text((source / "1" / "model.py").read_text())
    (model / "config.pbtxt").write_text((source / "config.pbtxt").read_text())
    return str(model.parent)


def test_close_after_the_server_crashed_kills_its_backend_stubs(python_model_repository: str) -> None:
    server = TritonServer(ServerConfig(model_repository=python_model_repository, load_models=("identity",)))
    server.start()
    leader = server.pid
    assert leader is not None
    try:
        stubs = [pid for pid in _group_members(leader) if pid != leader]
        assert stubs, "the Python backend started no stub in the server's group"
        os.kill(leader, signal.SIGKILL)  # a crash: the leader dies, its stubs do not
        assert wait_for(lambda: not server.is_alive(), 30), "the killed server still runs"
        server.close()
        left = _group_members(leader)
        assert not left, f"backend stubs {left} outlived their crashed server's close()"
    finally:
        for pid in _group_members(leader):
            os.kill(pid, signal.SIGKILL)
        server.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


_SLOW_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({seconds})

    def execute(self, requests):
        out = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return out
"""
_SLOW_CONFIG = """
name: "slow_load"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
LOAD_S = 4.0


@pytest.fixture
def slow_loading_repository(tmp_path: Path) -> str:
    """One Python model whose instance takes ``LOAD_S`` seconds to initialise."""
    model = tmp_path / "slow" / "slow_load"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(_SLOW_MODEL.format(seconds=LOAD_S))
    (model / "config.pbtxt").write_text(_SLOW_CONFIG)
    return str(model.parent)


def test_the_launch_listener_hears_of_the_server_before_its_models_load(slow_loading_repository: str) -> None:
    server = TritonServer(ServerConfig(model_repository=slow_loading_repository, load_models=("slow_load",)))
    heard: list[tuple[int, str, float]] = []

    def listener(pid: int, marker: str) -> None:
        # Only what the listener is told: right after the fork the child may not have run
        # exec yet, so its command line is read below, once the server runs.
        heard.append((pid, marker, time.monotonic()))

    server.on_launch = listener
    with server:
        ready_at = time.monotonic()
        assert len(heard) == 1, heard
        pid, marker, heard_at = heard[0]
        assert pid == server.pid and marker == server.process_marker and marker, (heard, server.pid)
        assert ready_at - heard_at >= LOAD_S * 0.9, "the listener heard of the server only once it was ready"
        assert marker.encode() in _cmdline(pid), "the server's command line does not carry its marker"
        stubs = [p for p in _group_members(pid) if p != pid]
        assert stubs and all(marker.encode() in _cmdline(p) for p in stubs), "a stub lacks the marker"
    assert server.process_marker == ""
