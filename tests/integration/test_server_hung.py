"""A hung (SIGSTOPped) Triton: probe says not ready, stop does not wait forever, kill reaps at once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ray_triton_shm import ServerConfig, TritonServer

REPO_MODELS = str(Path(__file__).resolve().parents[2] / "deployments" / "models")
# One Python-backend model (its stub is a child of the server to stop or kill too): a server with
# every model of the repository takes seconds more to start on a small machine.
MODELS = ("add_sub",)


def _gone(pid: int) -> bool:
    """Whether ``pid`` is gone (an unreaped zombie would still be there)."""
    return not os.path.exists(f"/proc/{pid}")


def test_stop_of_a_stopped_server_does_not_wait_forever():
    """TritonServer.stop on a SIGSTOPped process continues it to handle SIGINT (no Ray here)."""
    server = TritonServer(ServerConfig(model_repository=REPO_MODELS, load_models=MODELS, stop_timeout_s=60.0))
    server.start()
    try:
        pid = server.pid
        os.kill(pid, signal.SIGSTOP)
        assert server.is_alive() and not server.probe(timeout=0.5)
        started = time.monotonic()
        server.stop()
        took = time.monotonic() - started
    finally:
        server.kill()
    assert _gone(pid)
    assert took < 30.0, f"stop of a stopped server took {took:.1f}s"


def test_kill_of_a_stopped_server_reaps_it_at_once():
    server = TritonServer(ServerConfig(model_repository=REPO_MODELS, load_models=MODELS))
    server.start()
    try:
        pid = server.pid
        assert server.probe(timeout=2.0)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        server.kill()
        took = time.monotonic() - started
        assert not server.is_alive() and server.pid is None
        assert _gone(pid), "killed Triton not reaped"
        assert took < 10.0, took
        server.start()  # and it comes back
        assert server.probe(timeout=2.0)
    finally:
        server.stop()
