"""The server's process group: its Python-backend stubs go with it, however the server ended."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ray_triton_shm import ServerConfig, TritonServer

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


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


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
        assert _wait_until(lambda: not server.is_alive(), 30), "the killed server still runs"
        server.close()
        left = _group_members(leader)
        assert not left, f"backend stubs {left} outlived their crashed server's close()"
    finally:
        for pid in _group_members(leader):
            os.kill(pid, signal.SIGKILL)
        server.close()
