"""A hung (SIGSTOPped) Triton: probe says not ready, stop does not wait forever, kill reaps at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ray_triton_shm import ServerConfig, TritonServer
from ray_triton_shm._private.shm.segment import process_start_time
from ray_triton_shm.errors import ServerStartError
from tests.helpers import stop_process

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
        stop_process(pid)
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
        stop_process(pid)
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


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        if stat and int(stat[stat.rfind(b")") + 2 :].split()[2]) == pgid and int(entry) != pgid:
            members.append(int(entry))
    return members


def test_restart_of_a_server_killed_alone_kills_its_stubs_and_comes_back():
    """SIGKILL to the server's pid alone (not its group) leaves its Python-backend stubs running and
    holding its log pipe. A restart must kill them and start again, not wait on the pipe forever
    (a node's health check restarting such a Triton would hang in 'restarting' for good)."""
    server = TritonServer(ServerConfig(model_repository=REPO_MODELS, load_models=MODELS))
    server.start()
    stubs: list[int] = []
    restarted = threading.Event()
    restart = threading.Thread(target=lambda: (server.restart(kill=True), restarted.set()), daemon=True)
    try:
        pid = server.pid
        stubs = _group_members(pid)
        assert stubs, "the Python-backend model should run in a stub of the server's group"
        for stub in stubs:  # a stub that has not noticed its server died (as seen under load)
            stop_process(stub)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        restart.start()
        restart.join(timeout=60)
        assert restarted.is_set(), "restart hung on the dead server's log pipe, held by its stubs"
        # Killed (a zombie until init reaps it: the server that was its parent is gone).
        assert all(process_start_time(stub) is None for stub in stubs)
        assert server.pid != pid and server.probe(timeout=5.0)
    finally:
        for stub in stubs:  # lets a hung restart go on (and end)
            try:
                os.kill(stub, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if restart.is_alive():
            restart.join(timeout=60)
        server.stop()


def test_a_killed_server_leaves_no_python_backend_directory():
    """Triton's Python backend makes a directory in /tmp that only a clean exit removes: after a
    kill (or a crash), the server's stop removes it; after a clean stop none is left either."""
    server = TritonServer(ServerConfig(model_repository=REPO_MODELS, load_models=MODELS))
    try:
        # Another test's Triton starting beside this one makes its directory ambiguous (none is
        # taken): start again until this server's own is known.
        for _ in range(5):
            server.start()
            if server.python_env is not None:
                break
            server.stop()
        made = server.python_env
        assert made is not None and os.path.isdir(made), made
        os.kill(server.pid, signal.SIGKILL)  # a crash: nothing of Triton's own runs
        server.stop()
        assert not os.path.exists(made), "the killed server's directory is left"
        server.start()
        made = server.python_env
    finally:
        server.stop()
    assert made is None or not os.path.exists(made), "a cleanly stopped server left its directory"


def test_servers_started_at_once_each_know_their_own_python_backend_directory():
    """Launches take turns until their backends' directories appear: two servers started at once
    each take the directory their own backend made, and each one's stop after a kill removes it."""
    servers = [TritonServer(ServerConfig(model_repository=REPO_MODELS, load_models=MODELS)) for _ in range(2)]
    errors: list[BaseException] = []

    def start(server: TritonServer) -> None:
        try:
            server.start()
        except BaseException as e:  # seen by the test below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert not errors, errors
        made = [server.python_env for server in servers]
        assert None not in made and made[0] != made[1], made
        assert all(os.path.isdir(path) for path in made), made
        for server in servers:
            os.kill(server.pid, signal.SIGKILL)
            server.stop()
        assert not any(os.path.exists(path) for path in made), made
    finally:
        for server in servers:
            server.stop()


_SLOW_LOAD = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(60)

    def execute(self, requests):
        raise NotImplementedError
"""


def test_a_start_that_fails_while_models_load_leaves_no_python_backend_directory(tmp_path: Path):
    """The directory is known as soon as the backend makes it: a start that times out removes it."""
    model = tmp_path / "slow_load"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(_SLOW_LOAD)
    (model / "config.pbtxt").write_text(
        'name: "slow_load"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
    )
    config = ServerConfig(
        model_repository=str(tmp_path), load_models=("slow_load",), startup_timeout_s=5.0, stop_timeout_s=5.0
    )
    server = TritonServer(config)
    told: list[str | None] = []
    server.on_python_env = told.append
    try:
        with pytest.raises(ServerStartError, match="not ready"):
            server.start()
    finally:
        server.stop()
    assert told and told[0] is not None, told  # told while the model loaded, before any readiness
    assert not os.path.exists(told[0]), f"{told[0]} outlived the failed start"
    assert server.python_env is None
