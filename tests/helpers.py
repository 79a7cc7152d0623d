"""Small helpers the tests share (import them as ``from tests.helpers import ...``)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

# ``low-high``: the ports free_port hands out in this process (tests/lanes.py gives each lane
# its own range, below the kernel's ephemeral ports and above Ray's worker ports, so that two
# test processes never pick the same port, nor an outgoing connection take one before it is
# bound). Unset: the OS picks.
PORTS_ENV = "RAY_TRITON_SHM_TEST_PORTS"
_given: set[int] = set()
_given_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, never the same twice in one process.

    From the range in ``$RAY_TRITON_SHM_TEST_PORTS`` when set, else from the OS.
    """
    spec = os.environ.get(PORTS_ENV)
    with _given_lock:
        if spec:
            low, _, high = spec.partition("-")
            candidates = [p for p in range(int(low), int(high) + 1) if p not in _given]
            random.shuffle(candidates)
            port = next((p for p in candidates if _bindable(p)), None)
            if port is None:
                raise RuntimeError(f"no free port left in {PORTS_ENV}={spec}")
        else:
            while True:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                if port not in _given:
                    break
        _given.add(port)
        return port


_REPLICA = """
import os, sys
from ray_triton_shm._private.node.port_claim import PortClaim
from ray_triton_shm._private.serve.net.listener import TcpListener
claim = PortClaim({port}, "app")
sock = claim.listening_socket("127.0.0.1", "HTTP")
def serve(conn):
    conn.sendall(b"child\\n")
listener = TcpListener("127.0.0.1", {port}, serve, protocol="HTTP", listening=sock)
print(os.fstat(sock.fileno()).st_ino, flush=True)
sys.stdin.read()
"""


def replica_process(port: int) -> tuple[subprocess.Popen, int]:
    """A process that claims ``port`` for app ``"app"`` and serves its shared listening socket
    (answering ``child``) until killed; returns it and the socket's inode, once it listens."""
    child = subprocess.Popen(
        [sys.executable, "-c", _REPLICA.format(port=port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    return child, int(child.stdout.readline())


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (dead but not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``R``, ``S``, ``T``, ...; empty once it is gone)."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                states.append(f.read().rsplit(b")", 1)[1].split()[0].decode())
        except OSError:  # the thread ended meanwhile
            continue
    return states


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads has stopped.

    ``kill`` only queues the signal: one thread is woken to take it and stop the
    others, and until it gets a CPU (later on a loaded machine) the rest run on,
    so a server can still answer a request sent right after ``kill`` returns.

    Raises:
        TimeoutError: A thread still runs after ``timeout_s``.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if all(state in "TtZX" for state in states):  # stopped (or gone, which is not our case to judge)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not stop within {timeout_s} s: thread states {states}")
        time.sleep(0.001)


def assert_built_from_current_source(module) -> None:
    """In a checkout, the optional C extension ``module`` was built from its source as it is now (a
    source that no longer compiles leaves the last build in place)."""
    built = Path(module.__file__)
    name = built.name.split(".")[0]
    source = built.with_name(f"{name}.c")
    if source.is_file():
        assert built.stat().st_mtime >= source.stat().st_mtime, f"stale {name} build: pip install -e ."


def wait_for(predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> bool:
    """Whether ``predicate()`` became true within ``timeout_s`` (asked every ``poll_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape_prometheus(port: int) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on a Prometheus endpoint (``127.0.0.1:port/metrics``): (name, labels, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric_value(samples, name: str, **labels: str) -> float | None:
    """The sum of the samples named ``name`` that carry ``labels`` (``None``: no such sample)."""
    hits = [v for n, tags, v in samples if n == name and all(tags.get(k) == w for k, w in labels.items())]
    return sum(hits) if hits else None


# -- A raw HTTP/2 client, for what a well-behaved one never sends (frames by hand). --

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(length: int, kind: int, flags: int, stream: int) -> bytes:
    """An HTTP/2 frame's 9-byte head."""
    return length.to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big")


def h2_request_block(path: str) -> bytes:
    """The header block of a gRPC call of ``path`` (a fresh HPACK encoder's)."""
    from ray_triton_shm._private.bench.attacks.wire import request_block  # lazy: imports hpack

    return request_block(path)


def h2_whole_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream, payload) of each whole frame at the start of ``data``."""
    frames, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        if i + 9 + length > len(data):
            break
        frames.append((data[i + 3], int.from_bytes(data[i + 5 : i + 9], "big"), data[i + 9 : i + 9 + length]))
        i += 9 + length
    return frames


def h2_frames_until_closed(sock: socket.socket, timeout: float = 5.0) -> list[tuple[int, int, bytes]]:
    """The frames a server sends until it closes the connection (``timeout`` for each read)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            got = sock.recv(65536)
        except ConnectionResetError:
            break
        if not got:
            break
        data += got
    return h2_whole_frames(data)


def grpc_engine_serving(address: str) -> str:
    """Which gRPC engine serves ``address`` (``host:port``), told by its GOAWAY's debug text for a
    DATA frame on stream 0 (a connection error, in each engine's own words)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(H2_PREFACE + h2_frame(0, 4, 0, 0) + h2_frame(1, 0, 0, 0) + b"x")
        frames = h2_frames_until_closed(sock)
    debug = b"".join(payload[8:] for kind, _, payload in frames if kind == 7)
    if b"DATA on stream 0" in debug:
        return "python"
    if b"DATA: stream_id == 0" in debug:
        return "nghttp2"
    raise AssertionError(f"no GOAWAY either engine sends: {frames!r}")
