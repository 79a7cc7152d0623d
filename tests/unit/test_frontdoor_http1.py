"""The front door's HTTP/1.1 listener against hostile clients: real sockets on 127.0.0.1, small limits.

Strict framing (RFC 9112: each refusal answered, then the connection closed),
memory that grows with the bytes that arrive rather than the sizes announced,
time limits (a request head's total deadline, a body's minimum rate, the idle
wait, the answer's deadline), and a slot that never waits on a slow client.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest

from ray_triton_shm._private.serve.door import frontdoor_http
from ray_triton_shm._private.serve.door.calls import CallGate
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.door.frontdoor_http import KServeHttpHandler
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.http1.timing import HttpTimeouts
from ray_triton_shm._private.serve.net.bounded import ByteTurns
from ray_triton_shm.errors import ConfigError
from tests.helpers import wait_for

MAX_BYTES = 64 << 20


def _echo(conn, head, body) -> None:
    data = body.read_all(MAX_BYTES)
    conn.respond(200, [("content-type", "application/octet-stream")], [data])


@contextmanager
def _listening(handler: Any = _echo, **timeouts: float) -> Iterator[HttpListener]:
    door = HttpListener("127.0.0.1", 0, handler, timeouts=HttpTimeouts(**timeouts))
    try:
        yield door
    finally:
        door.close()


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    return s


def _read_to_close(s: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _refused(port: int, data: bytes) -> tuple[int, str]:
    """(status, error) of the answer to ``data``; asserts the server closed the connection after it."""
    with _connect(port) as s:
        s.sendall(data)
        answer = _read_to_close(s)  # returns only once the server closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head
    return int(head.split(b" ")[1]), json.loads(body)["error"]


# -- strict framing ---------------------------------------------------------

_GOOD = b"POST /x HTTP/1.1\r\nHost: a\r\n"


@pytest.mark.parametrize(
    ("data", "status", "message"),
    [
        # Content-Length and Transfer-Encoding (RFC 9112 6.1, 6.3)
        (_GOOD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "together"),
        (_GOOD + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", 400, "together"),
        (_GOOD + b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501, "unsupported Transfer-Encoding"),
        (_GOOD + b"Transfer-Encoding: chunked, chunked\r\n\r\n", 400, "more than once"),
        (_GOOD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "more than once"),
        (_GOOD + b"Transfer-Encoding: chunked, gzip\r\n\r\n", 400, "does not end with chunked"),
        (_GOOD + b"Transfer-Encoding: xchunked\r\n\r\n", 400, "does not end with chunked"),
        (_GOOD + b"Transfer-Encoding: ,chunked\r\n\r\n", 400, "does not end with chunked"),
        (b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "HTTP/1.0"),
        # Content-Length
        (_GOOD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "conflicting"),
        (_GOOD + b"Content-Length: +5\r\n\r\n", 400, "invalid Content-Length"),
        (_GOOD + b"Content-Length: 0x5\r\n\r\n", 400, "invalid Content-Length"),
        (_GOOD + b"Content-Length: 5, 5\r\n\r\n", 400, "invalid Content-Length"),
        (_GOOD + b"Content-Length: 1_0\r\n\r\n", 400, "invalid Content-Length"),
        (_GOOD + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 413, "too large"),
        # line ends, folding, names and values
        (b"GET / HTTP/1.1\nHost: a\n\n", 400, "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: a\nX-Smuggle: 1\r\n\r\n", 400, "bare CR or LF"),
        (b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", 400, "bare CR or LF"),
        (b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 400, "obsolete line folding"),
        (b"GET / HTTP/1.1\r\nX: a\r\n\tb\r\n\r\n", 400, "obsolete line folding"),
        (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "malformed header line"),
        (b"GET / HTTP/1.1\r\nX(y): a\r\n\r\n", 400, "malformed header line"),
        (b"GET / HTTP/1.1\r\n: a\r\n\r\n", 400, "malformed header line"),
        (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400, "control character"),
        (b"GET / HTTP/1.1\r\nX: a\x7fb\r\n\r\n", 400, "control character"),
        (b"GET / HTTP/1.1\r\nX: a\x0bb\r\n\r\n", 400, "control character"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "more than one Host"),
        # the request line
        (b"GET  / HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"GET /\tHTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/1.1 x\r\n\r\n", 400, "malformed request line"),
        (b"GET / http/1.1\r\n\r\n", 400, "malformed request line"),
        (b"G@T / HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"GET /a\x01b HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"\r\nGET / HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/1.2\r\n\r\n", 505, "protocol version"),
    ],
)
def test_a_malformed_head_is_refused_and_its_connection_closed(
    data: bytes, status: int, message: str
) -> None:
    with _listening() as door:
        assert _refused(door.port, data)[0] == status
        got = _refused(door.port, data)[1]
        assert message in got


_CHUNKED = _GOOD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        (b"0x5\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"+5\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"-1\r\nx\r\n0\r\n\r\n", "malformed chunk size"),
        (b" 5\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"5 \r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"5_0\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"1" + b"0" * 16 + b"\r\nhello\r\n0\r\n\r\n", "more than 16 hex digits"),
        (b"5;a\x01b\r\nhello\r\n0\r\n\r\n", "malformed chunk size"),
        (b"5;" + b"e" * 2000 + b"\r\nhello\r\n0\r\n\r\n", "line over"),
        ((b"1;" + b"e" * 1000 + b"\r\nx\r\n") * 20 + b"0\r\n\r\n", "chunk extensions over"),
        (b"5\nhello\r\n0\r\n\r\n", "bare LF"),
        (b"5\r\nhello\n0\r\n\r\n", "not followed by CRLF"),
        (b"3\r\nhello\r\n0\r\n\r\n", "not followed by CRLF"),
        (b"5\r\nhello\r\n0\r\nX: a\r\n b\r\n\r\n", "malformed trailer"),
        (b"5\r\nhello\r\n0\r\nX: a\x00\r\n\r\n", "control character in trailer"),
        (b"5\r\nhello\r\n0\r\nX: a\nY: b\r\n\r\n", "bare LF"),
    ],
)
def test_a_malformed_chunked_body_is_refused_and_its_connection_closed(chunks: bytes, message: str) -> None:
    with _listening() as door:
        status, error = _refused(door.port, _CHUNKED + chunks)
    assert status == 400 and message in error


def test_well_formed_requests_still_pass() -> None:
    with _listening() as door, _connect(door.port) as s:
        s.sendall(
            _GOOD
            + b"Content-Length: 3\r\nContent-Length: 3\r\nX: a\tb \xe9\r\n\r\nabc"  # same length twice
            + _GOOD
            + b"Transfer-Encoding: Chunked\r\n\r\n"
            + b"A;name=value ; other\r\n0123456789\r\n0\r\nTrailer: yes\r\n\r\n"
            + _GOOD
            + b"Content-Length: 1\r\nConnection: close\r\n\r\nZ"
        )
        answer = _read_to_close(s)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert b"\r\n\r\nabc" in answer and b"\r\n\r\n0123456789" in answer and answer.endswith(b"\r\n\r\nZ")


# -- memory -----------------------------------------------------------------


@pytest.mark.parametrize(
    "head",
    [
        _GOOD + b"Content-Length: 40000000\r\n\r\n",
        _CHUNKED + b"2000000\r\n",  # one chunk of 32 MiB
    ],
)
def test_memory_grows_with_the_bytes_that_arrive_not_the_size_announced(head: bytes) -> None:
    reading = threading.Event()

    def handler(conn, head, body) -> None:
        reading.set()
        body.read_all(MAX_BYTES)

    tracemalloc.start()
    try:
        with _listening(handler) as door, _connect(door.port) as s:
            s.sendall(head + b"x" * 1000)
            assert reading.wait(5)
            time.sleep(0.3)  # the server is waiting for the rest
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes held for a body of 1000 bytes"


# -- time ---------------------------------------------------------------------


def test_a_trickled_head_meets_a_total_deadline() -> None:
    with _listening(head_s=0.5, idle_s=5) as door, _connect(door.port) as s:
        began = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\n")
        answer = b""
        while time.monotonic() - began < 5 and not answer:
            try:
                s.sendall(b"X: a\r\n")  # a byte well within any per-read timeout
            except OSError:
                break
            s.settimeout(0.1)
            try:
                answer = s.recv(1000)
            except TimeoutError:
                pass
        elapsed = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
    assert b"request head not received within 0.5 s" in answer
    assert elapsed < 4


def test_a_body_slower_than_the_minimum_rate_is_cut_off() -> None:
    with _listening(body_grace_s=0.3, body_min_rate=1000) as door, _connect(door.port) as s:
        began = time.monotonic()
        s.sendall(_GOOD + b"Content-Length: 100000\r\n\r\n")
        answer = b""
        while time.monotonic() - began < 5 and not answer:
            try:
                s.sendall(b"x" * 10)  # 100 bytes/s, never silent for the grace time
            except OSError:
                break
            s.settimeout(0.1)
            try:
                answer = s.recv(1000)
            except TimeoutError:
                pass
        elapsed = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 408 ") and b"too slowly" in answer
        assert elapsed < 4
        _read_to_close(s)  # and closed


def test_the_servers_own_time_between_reads_is_not_held_against_the_body() -> None:
    def handler(conn, head, body) -> None:
        first = body.read(10)
        time.sleep(0.8)  # the server busy (waiting for a slot, say) past the body's grace time
        conn.respond(200, [], [first, body.read_all()])

    with _listening(handler, body_grace_s=0.3, body_min_rate=1000) as door, _connect(door.port) as s:
        s.sendall(_GOOD + b"Content-Length: 20000\r\nConnection: close\r\n\r\n" + b"y" * 20000)
        answer = _read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"y" * 20000)


def test_a_content_length_past_the_limit_is_refused_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    with _door(monkeypatch, stall_s=1.0) as (port, client):
        request = _GOOD.replace(b"/x", b"/v2/models/m/infer") + b"Content-Length: %d\r\n\r\n" % (
            MAX_BYTES + 1
        )
        status, error = _refused(port, request)  # answered, and closed, with no byte of the body sent
    assert status == 413 and "exceeds the maximum" in error and client.calls == []


def test_an_idle_connection_is_closed_after_the_idle_timeout() -> None:
    with _listening(idle_s=0.3) as door, _connect(door.port) as s:
        s.sendall(_GOOD + b"Content-Length: 1\r\n\r\nx")
        assert s.recv(1000).endswith(b"\r\n\r\nx")
        began = time.monotonic()
        assert s.recv(1000) == b""
        assert 0.2 < time.monotonic() - began < 4


def test_hundreds_of_idle_connections_cost_no_thread_and_lock_no_caller_out() -> None:
    door = HttpListener("127.0.0.1", 0, _echo, max_connections=4)
    before = threading.active_count()
    idle = []
    try:
        for i in range(300):
            s = _connect(door.port)
            if i % 2:  # half of them make a request first, then keep the connection open and quiet
                s.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            idle.append(s)
        assert wait_for(lambda: len(door.open_connections()) == 300, 10)
        time.sleep(0.3)  # past the linger: every idle connection is parked
        assert threading.active_count() - before <= 8  # the workers, not a thread per socket
        with _connect(door.port) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
            assert _read_to_close(s).endswith(b"hello")
    finally:
        for s in idle:
            s.close()
        door.close()


def test_an_answer_the_client_does_not_read_ends_its_connection() -> None:
    answer = bytes(32 << 20)
    ended = threading.Event()

    def handler(conn, head, body) -> None:
        body.read_all()
        try:
            conn.respond(200, [], [answer])
        finally:
            ended.set()

    with _listening(handler, send_s=0.5) as door, _connect(door.port, rcvbuf=4096) as s:
        s.sendall(_GOOD + b"Content-Length: 0\r\n\r\n")
        began = time.monotonic()
        assert ended.wait(5)  # the handler gave up on the client that reads nothing
        assert time.monotonic() - began < 4
        deadline = time.monotonic() + 4
        while door.open_connections() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not door.open_connections()


# -- config -------------------------------------------------------------------


def test_config_time_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HEAD_TIMEOUT_S", "IDLE_TIMEOUT_S", "BODY_GRACE_S", "BODY_MIN_RATE", "SEND_TIMEOUT_S"):
        monkeypatch.delenv(f"RAY_TRITON_SHM_FRONTDOOR_HTTP_{name}", raising=False)
    monkeypatch.delenv("RAY_TRITON_SHM_FRONTDOOR_HTTP_SLOT_STALL_S", raising=False)
    config = FrontDoorConfig(http_port=0)
    assert config.http_timeouts == HttpTimeouts(
        head_s=60.0, idle_s=60.0, body_grace_s=20.0, body_min_rate=500.0, send_s=60.0
    )
    assert config.http_slot_stall_s == 1.0
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_HTTP_IDLE_TIMEOUT_S", "5.5")
    assert FrontDoorConfig(http_port=0).http_timeouts.idle_s == 5.5
    assert FrontDoorConfig.from_args({"http_port": 0, "http_send_timeout_s": 3}).http_timeouts.send_s == 3.0
    for name in (
        "http_head_timeout_s",
        "http_idle_timeout_s",
        "http_body_grace_s",
        "http_body_min_rate",
        "http_send_timeout_s",
        "http_slot_stall_s",
    ):
        for bad in (0, -1, float("inf"), float("nan"), True, "1"):
            with pytest.raises(ConfigError, match=name):
                FrontDoorConfig(http_port=0, **{name: bad})
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_HTTP_SLOT_STALL_S", "soon")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_FRONTDOOR_HTTP_SLOT_STALL_S"):
        FrontDoorConfig(http_port=0)


# -- slots and slow clients ---------------------------------------------------------


class _Lease:
    """A slot of the fake client: its inputs are arrays it scribbles over when it goes back."""

    def __init__(self, client: _Client) -> None:
        self._client = client
        self.pool = client  # its ``waiting``: callers waiting for a slot
        self.buffers: dict[str, np.ndarray] = {}
        self.released = False

    def __enter__(self) -> _Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def input(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.buffers:
            self.buffers[name] = np.zeros(shape, np.float32)
        return self.buffers[name]

    def release(self) -> None:
        if not self.released:
            self.released = True
            for array in self.buffers.values():
                array[...] = -1.0  # the slot's next user: whatever was sent from here after this is wrong
            with self._client.lock:
                self._client.held -= 1


class _Client:
    """A node client with one model whose output is its input (``Y = X``), counting slots held."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.waiting = 0
        self.leases = 0
        self.calls: list[str] = []

    def lease(self, model: str) -> _Lease:
        with self.lock:
            self.held += 1
            self.leases += 1
        return _Lease(self)

    def run(self, lease: _Lease, outputs: Any) -> dict[str, np.ndarray]:
        self.calls.append("run")
        return {"Y": lease.buffers["X"]}

    def infer(self, model: str, inputs: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
        self.calls.append("infer")
        return {"Y": np.array(inputs["X"])}


def _infer_request(values: np.ndarray) -> bytes:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [values.size],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return (
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: a\r\n"
        + f"Inference-Header-Content-Length: {len(header)}\r\n".encode()
        + f"Content-Length: {len(header) + values.nbytes}\r\n\r\n".encode()
        + header
    )


def _answer_values(s: socket.socket, count: int) -> np.ndarray:
    whole = _answer_body(s)
    return np.frombuffer(whole, np.float32, offset=len(whole) - 4 * count)


def _answer_body(s: socket.socket) -> bytearray:
    """The body of the next answer on ``s``, a 200."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), data[:300]
    length = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
    whole = bytearray(length)
    whole[: len(body)] = body
    view, have = memoryview(whole), len(body)
    while have < length:
        got = s.recv_into(view[have:])
        assert got, "closed mid-answer"
        have += got
    return whole


@contextmanager
def _door(
    monkeypatch: pytest.MonkeyPatch,
    stall_s: float,
    max_unsent_bytes: int = frontdoor_http.MAX_UNSENT_BYTES,
    gate: CallGate | None = None,
    busy_stall_s: float = 0.1,
    max_json_bytes: int = frontdoor_http.MAX_JSON_BYTES,
    **timeouts: float,
) -> Iterator[tuple[int, _Client]]:
    monkeypatch.setattr(frontdoor_http, "shm_plan", lambda *args: True)
    client = _Client()

    def delegate(head, data):
        return 404, [], b"{}"

    handler = KServeHttpHandler(
        client,
        lambda model: "1",
        delegate,
        frontdoor_http.error_answer,
        MAX_BYTES,
        slot_stall_s=stall_s,
        max_unsent_bytes=max_unsent_bytes,
        gate=gate,
        busy_stall_s=busy_stall_s,
        max_json_bytes=max_json_bytes,
    )
    with _listening(handler, **timeouts) as door:
        yield door.port, client


def test_a_prompt_client_is_read_into_and_answered_from_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.arange(1 << 18, dtype=np.float32)
    with _door(monkeypatch, stall_s=5.0) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + values.tobytes())
        np.testing.assert_array_equal(_answer_values(s, values.size), values)
        assert client.calls == ["run"]  # the zero-copy path: no copy into memory, no second lease
        assert wait_for(lambda: client.held == 0)


def test_a_stalled_body_gives_its_slot_back_and_is_finished_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = np.arange(1 << 16, dtype=np.float32)
    data = values.tobytes()
    with _door(monkeypatch, stall_s=0.2) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + data[:1000])
        assert wait_for(lambda: client.held == 1)  # leased, half filled
        assert wait_for(lambda: client.held == 0)  # given back while the client dawdles
        s.sendall(data[1000:])
        np.testing.assert_array_equal(_answer_values(s, values.size), values)
        # Read whole into memory, then run in a slot leased again (a slot of the first does not wait).
        assert (client.calls, client.leases) == (["run"], 2)
        assert wait_for(lambda: client.held == 0)


def test_a_trickled_body_gives_its_slot_back_though_no_read_waits_the_stall_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte every 0.05 s never lets one read wait the 0.3 s stall time, yet the slot goes back."""
    values = np.arange(1 << 16, dtype=np.float32)
    data = values.tobytes()
    with _door(monkeypatch, stall_s=0.3) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + data[:1000])
        assert wait_for(lambda: client.held == 1)
        started, sent = time.monotonic(), 1000
        while client.held and time.monotonic() - started < 5:
            s.sendall(data[sent : sent + 1])
            sent += 1
            time.sleep(0.05)
        assert client.held == 0 and time.monotonic() - started < 2, "the slot kept at the trickler's pace"
        s.sendall(data[sent:])
        np.testing.assert_array_equal(_answer_values(s, values.size), values)
        assert (client.calls, client.leases) == (["run"], 2)


def test_a_body_too_slow_while_in_a_slot_gets_408_and_its_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.arange(1 << 16, dtype=np.float32)
    with _door(monkeypatch, stall_s=10.0, body_grace_s=0.3) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + values.tobytes()[:1000])
        answer = _read_to_close(s)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
        assert wait_for(lambda: client.held == 0)
        assert client.calls == []


def test_an_answer_not_taken_is_copied_out_and_the_slot_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: more than the sockets' buffers hold
    with _door(monkeypatch, stall_s=0.2) as (port, client), _connect(port, rcvbuf=4096) as s:
        s.sendall(_infer_request(values) + values.tobytes())
        assert wait_for(lambda: client.calls == ["run"])
        assert wait_for(lambda: client.held == 0)  # while the client has read nothing
        # The slot was scribbled over when it went back: the answer still holds the outputs.
        np.testing.assert_array_equal(_answer_values(s, values.size), values)


def test_answers_not_taken_are_held_up_to_a_budget_then_their_connections_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = np.arange(4 << 20, dtype=np.float32)  # a 16 MiB answer; the budget holds one
    with (
        _door(monkeypatch, stall_s=0.2, max_unsent_bytes=24 << 20) as (port, client),
        _connect(port, rcvbuf=4096) as first,
        _connect(port, rcvbuf=4096) as second,
    ):
        first.sendall(_infer_request(values) + values.tobytes())
        assert wait_for(lambda: client.calls == ["run"])
        assert wait_for(lambda: client.held == 0)  # the first answer copied out and held
        second.sendall(_infer_request(values) + values.tobytes())
        assert wait_for(lambda: client.calls == ["run", "run"])
        assert wait_for(lambda: client.held == 0)  # its slot back too
        assert len(_read_to_close(second)) < values.nbytes  # no room to hold it: the connection ended
        np.testing.assert_array_equal(_answer_values(first, values.size), values)  # the held one whole


def test_an_answer_not_taken_at_all_ends_at_the_send_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.arange(4 << 20, dtype=np.float32)
    with _door(monkeypatch, stall_s=0.1, send_s=0.5) as (port, client), _connect(port, rcvbuf=4096) as s:
        s.sendall(_infer_request(values) + values.tobytes())
        assert wait_for(lambda: client.calls == ["run"])
        assert wait_for(lambda: client.held == 0)
        time.sleep(1.0)  # the deadline passes: the server closes, what it had queued is all that comes
        assert len(_read_to_close(s)) < values.nbytes


def test_clients_that_send_or_read_slowly_do_not_hold_the_call_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three answers never read and three trickled bodies, against a bound of two calls: each slow
    client's call counts only while the replica works on it, so a prompt caller is still answered."""
    gate = CallGate(2)
    big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB answers: more than the sockets' buffers hold
    small = np.arange(1 << 10, dtype=np.float32)
    with _door(monkeypatch, stall_s=0.2, gate=gate) as (port, client), ExitStack() as stack:
        readers = [stack.enter_context(_connect(port, rcvbuf=4096)) for _ in range(3)]
        tricklers = [stack.enter_context(_connect(port)) for _ in range(3)]
        for s in readers:
            s.sendall(_infer_request(big) + big.tobytes())
        for s in tricklers:
            s.sendall(_infer_request(small) + small.tobytes()[:100])
        assert wait_for(lambda: client.calls.count("run") == 3), client.calls  # each answer computed
        assert wait_for(lambda: client.held == 0)  # answers copied out, trickled bodies moved to memory
        for s in tricklers:
            s.sendall(b"\x00")  # still sending
        with _connect(port) as s:
            s.sendall(_infer_request(small) + small.tobytes())
            np.testing.assert_array_equal(_answer_values(s, small.size), small)
        assert (gate.ongoing, gate.refused) == (0, 0)
        np.testing.assert_array_equal(_answer_values(readers[0], big.size), big)  # a slow reader's, whole


def test_a_call_past_the_bound_once_its_body_is_read_is_refused_and_the_connection_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body that moved to memory meets the bound only once it is whole: refused 503, read, kept alive."""
    gate = CallGate(1)
    values = np.arange(1 << 12, dtype=np.float32)
    data = values.tobytes()
    with _door(monkeypatch, stall_s=0.2, gate=gate) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + data[:100])
        assert wait_for(lambda: client.held == 1)
        assert wait_for(lambda: client.held == 0)  # stalled: in memory now, not counted
        with gate.running():  # the bound is full when the body completes
            s.sendall(data[100:])
            head = s.recv(1 << 16)
            assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" not in head.lower()
        s.sendall(_infer_request(values) + data)  # the same connection, a call that fits
        np.testing.assert_array_equal(_answer_values(s, values.size), values)
        assert gate.refused == 1 and client.calls == ["run"]


def test_while_others_wait_for_a_slot_a_slow_client_keeps_it_only_the_busy_stall_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With callers waiting for the pool, a stalled body and an answer not taken give their slots
    back after ``busy_stall_s``, not the (here long) ``slot_stall_s``."""
    values = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: more than the sockets' buffers hold
    with _door(monkeypatch, stall_s=30.0, busy_stall_s=0.2) as (port, client):
        client.waiting = 1
        with _connect(port) as s:
            s.sendall(_infer_request(values) + values.tobytes()[:1000])
            assert wait_for(lambda: client.held == 1)
            started = time.monotonic()
            assert wait_for(lambda: client.held == 0)
            assert time.monotonic() - started < 5, "the slot kept for slot_stall_s though others wait"
        with _connect(port, rcvbuf=4096) as s:
            s.sendall(_infer_request(values) + values.tobytes())
            assert wait_for(lambda: client.calls.count("run") == 1)
            started = time.monotonic()
            assert wait_for(lambda: client.held == 0)
            assert time.monotonic() - started < 5, "the answer kept its slot though others wait"
            np.testing.assert_array_equal(_answer_values(s, values.size), values)  # whole, from the copy


def test_a_body_read_into_its_slot_before_others_waited_keeps_it_only_the_busy_stall_time_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trickled body whose slot was leased while no one waited: once callers wait for the pool,
    the read (looking again each busy-stall tick) gives the slot back within the busy stall time."""
    values = np.arange(1 << 16, dtype=np.float32)
    data = values.tobytes()
    with _door(monkeypatch, stall_s=30.0, busy_stall_s=0.2) as (port, client), _connect(port) as s:
        s.sendall(_infer_request(values) + data[:1000])
        assert wait_for(lambda: client.held == 1)
        started = time.monotonic()
        while time.monotonic() - started < 1.0:  # a byte now and then: within the (long) stall time
            s.sendall(data[1000:1001])
            time.sleep(0.1)
        assert client.held == 1
        client.waiting = 1
        busy_at = time.monotonic()
        assert wait_for(lambda: client.held == 0, 10)
        assert time.monotonic() - busy_at < 2, "the slot kept for slot_stall_s though others wait"


def _json_request(values: np.ndarray) -> bytes:
    body = json.dumps(
        {"inputs": [{"name": "X", "shape": [values.size], "datatype": "FP32", "data": values.tolist()}]}
    )
    head = f"POST /v2/models/m/infer HTTP/1.1\r\nHost: a\r\nContent-Length: {len(body)}\r\n\r\n"
    return (head + body).encode()


def test_an_answer_of_json_outputs_gives_its_slot_back_before_it_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A JSON answer is not sent from the slot: its outputs are copied out and the slot goes back
    before the answer is encoded and written, however long the client takes to read it."""
    values = np.arange(1 << 19, dtype=np.float32)  # a JSON answer of about 5 MB
    with _door(monkeypatch, stall_s=60.0) as (port, client), _connect(port, rcvbuf=4096) as s:
        s.sendall(_json_request(values))
        assert wait_for(lambda: client.calls == ["run"])
        assert wait_for(lambda: client.held == 0)  # while the client has read nothing
        # The slot was scribbled over when it went back: the answer still holds the outputs.
        assert json.loads(_answer_body(s))["outputs"][0]["data"] == values.tolist()


@pytest.mark.parametrize("room_for", [1, 3])
def test_json_bodies_are_decoded_within_max_json_bytes_in_turn(
    monkeypatch: pytest.MonkeyPatch, room_for: int
) -> None:
    """Three JSON bodies at once: as many decode together as ``max_json_bytes`` has room for, the rest
    wait their turn, not counted against the call bound meanwhile; every answer is right."""
    values = np.arange(1000, dtype=np.float32)
    request = _json_request(values)
    decode, inside, most, counted = frontdoor_http.kserve.decode_request, [0], [0], []
    lock = threading.Lock()
    gate = CallGate()

    def slow_decode(data, header_length):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        # Counted half-way through the decoding: a call decoded before has long been answered
        # (its own count gone), and a call waiting for its turn would be counted throughout.
        time.sleep(0.15)
        counted.append(gate.ongoing)
        time.sleep(0.15)
        with lock:
            inside[0] -= 1
        return decode(data, header_length)

    monkeypatch.setattr(frontdoor_http.kserve, "decode_request", slow_decode)
    body_bytes = len(request) - request.index(b"\r\n\r\n") - 4
    with _door(monkeypatch, stall_s=5.0, gate=gate, max_json_bytes=room_for * body_bytes) as (port, client):
        with ExitStack() as stack:
            sockets = [stack.enter_context(_connect(port)) for _ in range(3)]
            for s in sockets:
                s.sendall(request)
            for s in sockets:
                assert json.loads(_answer_body(s))["outputs"][0]["data"] == values.tolist()
    assert most[0] == room_for
    assert max(counted) <= room_for  # the ones waiting for their turn do not count
    assert gate.total == 3 and gate.ongoing == 0 and client.held == 0


def test_byte_turns_go_in_order_and_a_turn_larger_than_the_room_waits_for_all_of_it() -> None:
    turns = ByteTurns(10)
    order: list[str] = []

    def take(name: str, n: int) -> None:
        with turns.turn(n):
            order.append(name)

    with turns.turn(6):
        large = threading.Thread(target=take, args=("large", 50))  # more than the room: all of it
        large.start()
        assert wait_for(lambda: turns.waiting == 1)
        small = threading.Thread(target=take, args=("small", 1))  # fits now, but comes after
        small.start()
        assert wait_for(lambda: turns.waiting == 2)
        time.sleep(0.1)
        assert order == [] and turns.used == 6
    large.join(10)
    small.join(10)
    assert order == ["large", "small"] and turns.used == 0 and turns.waiting == 0


def _post(s: socket.socket, path: str, body: bytes) -> None:
    s.sendall(
        b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body
    )


def _status(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(1 << 16)
        assert chunk, "closed before an answer"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(1 << 16)
    return int(head.split()[1]), body


def test_bodies_read_into_memory_are_held_within_the_listeners_budget() -> None:
    """A body read into memory takes from ``max_buffered_bytes`` as it grows: while one holds most of it,
    another that does not fit is answered 503 (its connection kept), and all of it is back after."""
    delegated: list[int] = []

    def delegate(head, data):
        delegated.append(len(data))
        return 200, [("content-type", "application/json")], b"{}"

    handler = KServeHttpHandler(_Client(), lambda m: "1", delegate, frontdoor_http.error_answer, MAX_BYTES)
    door = HttpListener("127.0.0.1", 0, handler, max_buffered_bytes=1 << 20)
    try:
        with _connect(door.port) as holder, _connect(door.port) as other:
            whole = b"x" * (700 << 10)
            holder.sendall(
                b"POST /v2/repository/index HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % len(whole)
                + whole[: 600 << 10]
            )
            assert wait_for(lambda: door.buffered.used >= 512 << 10)  # held while the rest is awaited
            _post(other, "/v2/repository/index", whole)
            status, answer = _status(other)
            assert status == 503 and b"http_max_buffered_bytes" in answer, answer
            holder.sendall(whole[600 << 10 :])
            assert _status(holder)[0] == 200
            assert wait_for(lambda: door.buffered.used == 0)
            _post(other, "/v2/repository/index", whole)  # the same connection: room now
            assert _status(other)[0] == 200
        assert delegated == [len(whole), len(whole)]
        assert wait_for(lambda: door.buffered.used == 0)
    finally:
        door.close()
