"""The Triton server process: start, addresses, version, segments, stop, errors, and dying with its parent."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import ServerConfig, ServerNotFoundError, ServerStartError, TritonServer
from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.triton.process import remove_python_env
from ray_triton_shm.server import find_tritonserver
from tests.helpers import wait_for

from .footprint import fd_targets

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "deployments" / "models"
BINARY_ENV = "RAY_TRITON_SHM_TRITONSERVER"
_SOURCE_RE = re.compile(r"^(explicit|PATH|system|embedded \(.+\))$")
# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp{,6} spell them.
_LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


# -- helpers ---------------------------------------------------------------
def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode() for part in f.read().split(b"\0") if part]
    except FileNotFoundError:
        return []


def _stat_fields(pid: int) -> list[bytes]:
    """Fields of /proc/<pid>/stat after the command name (state first); raises if gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 :].split()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in items if b"=" in item)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return _stat_fields(pid)[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def _parent_pid(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def _backend_prefix(pid: int) -> str:
    """The Python backend's shm-region-prefix-name, read from the server's command line."""
    for arg in _cmdline(pid):
        m = re.search(r"shm-region-prefix-name=(\S+)$", arg)
        if m:
            return m.group(1)
    raise AssertionError(f"no shm-region-prefix-name in the command line of pid {pid}: {_cmdline(pid)}")


def _pids_mentioning(text: str) -> list[int]:
    """Running processes with ``text`` in their command line (e.g. the stubs of one server)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            if any(text in arg for arg in _cmdline(int(entry))) and _running(int(entry)):
                found.append(int(entry))
    return found


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def _ready(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _embedded_binary_and_env(tmp_path: Path) -> tuple[str, str | None]:
    """The binary a default config would run, and its Python environment (if it has one)."""
    plan = find_tritonserver(ServerConfig(model_repository=str(tmp_path)), provision=False)
    env_dir = str(Path(plan.path_prefix[0]).parent) if plan.path_prefix else None
    return plan.binary, env_dir


@pytest.fixture
def empty_repository(tmp_path: Path) -> str:
    """A model repository with no models: a server on it starts and stops in well under a second."""
    repo = tmp_path / "empty_models"
    repo.mkdir()
    return str(repo)


@pytest.fixture
def not_executable(tmp_path: Path) -> str:
    path = tmp_path / "tritonserver-not-executable"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o644)
    return str(path)


# -- the shared server -----------------------------------------------------
def test_server_binds_loopback_on_free_ports_and_reports_version(triton_server: TritonServer) -> None:
    assert triton_server.config.host == "127.0.0.1"
    assert (triton_server.config.grpc_port, triton_server.config.http_port) == (0, 0), "ports were not free"
    ports = []
    for url in (triton_server.grpc_url, triton_server.http_url):
        host, port = url.rsplit(":", 1)
        assert host == "127.0.0.1"
        ports.append(int(port))
    metrics = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/metrics", triton_server.metrics_url)
    assert metrics, triton_server.metrics_url
    ports.append(int(metrics.group(1)))
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    for port in ports:
        # Listening, and on loopback only.
        addresses = _listening_addresses(port)
        assert addresses and addresses <= _LOOPBACK, (port, addresses)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    assert re.fullmatch(r"2\.51\.\d+", triton_server.version), triton_server.version
    assert _SOURCE_RE.match(triton_server.binary_source), triton_server.binary_source
    assert triton_server.is_alive() and _ready(triton_server)
    assert any(arg.endswith("tritonserver") for arg in _cmdline(triton_server.pid))


def test_metrics_endpoint_answers(triton_server: TritonServer) -> None:
    with urllib.request.urlopen(triton_server.metrics_url, timeout=5) as r:
        body = r.read().decode()
    assert "nv_inference_request_success" in body


# -- own servers -----------------------------------------------------------
@pytest.mark.slow
def test_stop_removes_backend_segments_and_is_idempotent() -> None:
    server = TritonServer(ServerConfig(model_repository=str(MODEL_REPOSITORY), load_models=("add_sub",)))
    server.stop()  # never started: a no-op
    server.start()
    try:
        pid = server.pid
        prefix = _backend_prefix(pid)
        assert prefix.startswith(segment.owner_tag() + "_pyb_")
        segments = sweep.list_segments(prefix)
        assert segments, f"no Python-backend segment with prefix {prefix} while running"
        assert _pids_mentioning(prefix), "no Python-backend stub running"
        # Triton never locks its files: the server holds a locked guard named by their prefix,
        # and neither Triton nor its stubs got a copy of that lock (it would outlive the owner).
        guard = prefix[:-1]
        guard_path = os.path.join(segment.SHM_DIR, guard)
        assert os.path.exists(guard_path) and not sweep._guard_free(guard)
        for child in (pid, *_pids_mentioning(prefix)):
            assert guard_path not in fd_targets(child), f"pid {child} holds the guard"
    finally:
        server.stop()
    assert not server.is_alive() and server.pid is None
    assert not _running(pid)
    assert sweep.list_segments(prefix) == []
    assert not os.path.exists(guard_path), "the guard outlived the server"
    assert wait_for(lambda: not _pids_mentioning(prefix), 15), "Python-backend stubs outlived the server"
    server.stop()
    assert not server.is_alive() and server.pid is None


@pytest.mark.slow
def test_bad_model_repository_raises_with_log_tail(tmp_path: Path) -> None:
    broken = tmp_path / "models" / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\n'
        'input [ { name: "X", data_type: TYPE_NOT_A_TYPE, dims: [ 4 ] } ]\n'
    )
    ours = segment.owner_tag() + "_pyb_"
    before = set(sweep.list_segments(ours))
    server = TritonServer(ServerConfig(model_repository=str(tmp_path / "models"), startup_timeout_s=60))
    with pytest.raises(ServerStartError) as info:
        server.start()
    err = info.value
    assert "broken/config.pbtxt" in err.log_tail, err.log_tail
    assert err.log_tail in str(err)
    assert "exited" in err.message
    assert not server.is_alive() and server.pid is None
    assert set(sweep.list_segments(ours)) == before


@pytest.mark.parametrize("kind", ["not executable", "missing"])
def test_binary_env_var_to_unusable_path_raises_not_found(
    monkeypatch: pytest.MonkeyPatch, not_executable: str, tmp_path: Path, empty_repository: str, kind: str
) -> None:
    path = not_executable if kind == "not executable" else str(tmp_path / "no-such-tritonserver")
    monkeypatch.setenv(BINARY_ENV, path)
    server = TritonServer(ServerConfig(model_repository=empty_repository))
    assert server.config.binary == path
    with pytest.raises(ServerNotFoundError, match=re.escape(path)):
        server.start()
    assert server.pid is None and not server.is_alive()


def test_explicit_binary_overrides_env_var(
    monkeypatch: pytest.MonkeyPatch, not_executable: str, tmp_path: Path, empty_repository: str
) -> None:
    binary, env_dir = _embedded_binary_and_env(tmp_path)
    monkeypatch.setenv(BINARY_ENV, not_executable)
    config = ServerConfig(model_repository=empty_repository, binary=binary, python_env=env_dir)
    assert config.binary == binary
    with TritonServer(config) as server:
        assert server.binary_source == "explicit"
        assert re.fullmatch(r"2\.51\.\d+", server.version)
        assert os.path.realpath(f"/proc/{server.pid}/exe") == os.path.realpath(binary)
        if env_dir is not None:
            path = _environ(server.pid)["PATH"]
            assert path.split(os.pathsep)[0] == os.path.join(env_dir, "bin")
        pid = server.pid
    assert not _running(pid)


def _minor_faults(pids: list[int]) -> int:
    return sum(int(_stat_fields(pid)[7]) for pid in pids)  # minflt, field 10


@pytest.fixture
def single_instance_identity(tmp_path: Path) -> str:
    """A repository with ``identity`` on one instance: one stub, which the warm-up surely reaches."""
    model = tmp_path / "one_stub_models" / "identity"
    (model / "1").mkdir(parents=True)
    source = MODEL_REPOSITORY / "identity"
    (model / "1" / "model.py").write_text((source / "1" / "model.py").read_text())
    config = (source / "config.pbtxt").read_text()
    assert "count: 2" in config, config
    (model / "config.pbtxt").write_text(config.replace("count: 2", "count: 1"))
    return str(model.parent)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [256 * 1024 * 1024, 0], ids=["tuned", "glibc-default"])
def test_stub_reuses_the_memory_of_large_input_copies(threshold: int, single_instance_identity: str) -> None:
    """The stub copies each input into a fresh numpy array; tuned, a 48 MB one reuses old pages.

    With glibc's defaults an allocation above 32 MiB is always a new mapping whose
    pages fault in (and are zeroed) on every request: that run must show it, or
    the tuned run proves nothing.
    """
    from ray_triton_shm import PoolConfig, TritonShmClient

    config = ServerConfig(
        model_repository=single_instance_identity,
        load_models=("identity",),
        malloc_mmap_threshold_bytes=threshold,
    )
    n = 12 * 1024 * 1024  # 48 MB of float32
    pool = PoolConfig(slots=1, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    x = np.arange(n, dtype=np.float32).reshape(1, n)
    with TritonServer(config) as server:
        stubs = [pid for pid in _pids_mentioning(_backend_prefix(server.pid)) if pid != server.pid]
        assert len(stubs) == 1, f"one instance, found stubs {stubs}"
        # /proc/<pid>/environ shows the start-up copy, in which glibc's loader cuts
        # GLIBC_TUNABLES after the first tunable; the faults below show the rest.
        tunables = _environ(stubs[0]).get("GLIBC_TUNABLES", "")
        assert (f"glibc.malloc.mmap_threshold={threshold}" in tunables) == bool(threshold), tunables
        pools = {"identity": pool}
        with TritonShmClient(url=server.grpc_url, http_url=server.http_url, pools=pools) as client:
            for _ in range(2):  # the first large copy faults its memory in
                np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            before = _minor_faults(stubs)
            calls = 6
            for _ in range(calls):
                np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            per_call = (_minor_faults(stubs) - before) / calls
    if threshold:
        assert per_call < 4, f"the stub page-faulted {per_call:.1f} times per 48 MB request"
    else:
        # 24 faults of 2 MB huge pages, or 12288 of 4 KB pages, per request.
        assert per_call >= 20, f"glibc's default run faulted only {per_call:.1f} times per request"


def test_server_survives_the_thread_that_started_it(empty_repository: str) -> None:
    """It dies with its parent process, not with the (short-lived) thread that called start()."""
    server = TritonServer(ServerConfig(model_repository=empty_repository))
    errors: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as e:
            errors.append(e)

    starter = threading.Thread(target=start)
    starter.start()
    starter.join(60)
    try:
        assert not errors, errors
        assert not wait_for(lambda: not server.is_alive(), 1.5), "server died with its starting thread"
        assert _ready(server)
    finally:
        server.stop()


_CHILD = """
import sys, time
from ray_triton_shm import ServerConfig, TritonServer

server = TritonServer(ServerConfig(model_repository=sys.argv[1], load_models=("add_sub",)))
server.start()
print(server.pid, server.python_env or "", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_server_dies_with_parent_and_leftovers_are_swept(tmp_path: Path, empty_repository: str) -> None:
    script = tmp_path / "child_starts_server.py"
    script.write_text(_CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(MODEL_REPOSITORY)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 90)
        assert ready, "the child did not start a server in time"
        pid, _, python_env = child.stdout.readline().strip().partition(" ")
        server_pid = int(pid)
        assert _running(server_pid) and _parent_pid(server_pid) == child.pid
        prefix = _backend_prefix(server_pid)
        assert prefix.startswith(f"{segment.SEGMENT_PREFIX}_{child.pid}_")
        assert sweep.list_segments(prefix), "the child's server made no Python-backend segment"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    assert wait_for(lambda: not _running(server_pid), 15), "tritonserver outlived its parent"
    assert wait_for(lambda: not _pids_mentioning(prefix), 15), "Python-backend stubs outlived the server"
    # A TritonServer has no reaper of its own (the node actor's has): its backend's directory
    # outlives an owner killed outright, and is the test's to remove.
    if python_env:
        assert os.path.isdir(python_env), python_env
        remove_python_env(python_env)

    # Whatever the killed parent left is stale now; plant leftovers of it so there surely are some.
    def plant(name: str) -> str:
        os.close(os.open(os.path.join(segment.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        return name

    live = segment.Segment.create(segment.new_segment_name("live"), 4096)
    try:
        planted = plant(f"{prefix}planted-1")
        assert planted in sweep.stale_segments()
        assert live.name not in sweep.stale_segments()
        # A later server start sweeps them ...
        with TritonServer(ServerConfig(model_repository=empty_repository)):
            assert sweep.list_segments(prefix) == []
        # ... and so does sweep_stale_segments() on its own.
        planted = plant(f"{prefix}planted-2")
        assert planted in sweep.sweep_stale_segments(prefix)  # only ours: other runs share /dev/shm
        assert sweep.list_segments(prefix) == []
        assert os.path.exists(os.path.join(segment.SHM_DIR, live.name)), "a live owner's segment was swept"
    finally:
        live.close()
        for name in sweep.list_segments(prefix):
            os.unlink(os.path.join(segment.SHM_DIR, name))
    assert not os.path.exists(os.path.join(segment.SHM_DIR, live.name))
