"""The HTTP/2 gRPC server's limits: memory, time and frame budgets set by the server, not the client.

Each test speaks raw HTTP/2 to a real listener on loopback and reads what the
server answers: a GOAWAY with its error code, a closed connection, a call that
never ran.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import hpack
import pytest

from ray_triton_shm._private.serve.http2.grpc_message import FIRST_BUFFER, MessageBuffer
from ray_triton_shm._private.serve.http2.h2_listener import H2Listener
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    Budget,
    H2Limits,
    frame_header,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget, SpareBuffers
from ray_triton_shm.errors import ConfigError
from tests.helpers import h2_frames_until_closed, h2_request_block, h2_whole_frames, wait_for

pytestmark = pytest.mark.usefixtures("grpc_engine")  # each test on each engine


@pytest.fixture
def server():
    listeners = []

    def start(handler=lambda call: call.respond([bytes(call.request())]), **options):
        listener = H2Listener("127.0.0.1", 0, handler, **options)
        listeners.append(listener)
        return listener

    yield start
    for listener in listeners:
        listener.close()
        assert not listener.open_connections()


def _connect(listener: H2Listener, ack: bool = True) -> socket.socket:
    """A raw connection: the client's settings, and the server's taken (``ack``: as every real
    client does at once)."""
    sock = socket.create_connection(("127.0.0.1", listener.port))
    sock.sendall(
        PREFACE + frame_header(0, SETTINGS, 0, 0) + (frame_header(0, SETTINGS, ACK, 0) if ack else b"")
    )
    return sock


def _goaway_code(frames: list[tuple[int, int, bytes]]) -> int | None:
    codes = [struct.unpack(">II", payload[:8])[1] for kind, _, payload in frames if kind == GOAWAY]
    return codes[0] if codes else None


def _request(stream_id: int, message: bytes, path: str = "/pkg.Svc/Echo", end: bool = True) -> bytes:
    block = h2_request_block(path)
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    return (
        frame_header(len(block), HEADERS, END_HEADERS, stream_id)
        + block
        + frame_header(len(body), DATA, END_STREAM if end else 0, stream_id)
        + body
    )


def test_a_message_buffer_grows_with_the_bytes_that_arrive_not_with_the_announced_length() -> None:
    class Source:
        def into(self, target: memoryview) -> None:
            target[:] = b"x" * len(target)

        def exactly(self, n: int) -> bytes:
            return b"x" * n

    buffer = MessageBuffer(1 << 30)  # announced: 1 GiB
    assert len(buffer.data) == FIRST_BUFFER
    received = 0
    for _ in range(40):
        received += buffer.take(Source(), 50_000)
        assert len(buffer.data) <= max(FIRST_BUFFER, 2 * received)
    assert received == buffer.filled == 2_000_000 and not buffer.full()
    small = MessageBuffer(10, b"abc")
    assert small.take(Source(), 100) == 7 and small.full() and bytes(small.data) == b"abcxxxxxxx"


def test_a_finished_message_buffer_is_reused_unless_a_view_of_it_lives() -> None:
    """A buffer given back is kept (within the spare limit) and taken by a later message of its size,
    which reads its own bytes into it; one still viewed is never kept."""

    class Source:
        def __init__(self, fill: int) -> None:
            self.fill = fill

        def into(self, view: memoryview) -> None:
            view[:] = bytes([self.fill]) * len(view)

    length = 4 * FIRST_BUFFER + 7
    spares = SpareBuffers(16 * length)
    budget = ByteBudget(1 << 30, "test", spares=spares)
    connection = ByteBudget(1 << 30, "connection", budget)
    assert connection.spares is spares  # a connection's budget keeps its listener's spares

    def message(fill: int) -> MessageBuffer:
        buffer = MessageBuffer(length, b"h", connection)
        while not buffer.full():
            buffer.take(Source(fill), 16384)
        assert bytes(buffer.data) == b"h" + bytes([fill]) * (length - 1)
        assert connection.used == budget.used == buffer.charged == len(buffer.data) == length
        return buffer

    first = message(1)
    kept = id(first.data)  # no reference of its own: one would keep the buffer from being kept
    first.free()
    assert connection.used == budget.used == 0
    assert spares.held >= length  # the whole buffer and the smaller ones it grew through
    second = message(2)
    assert id(second.data) == kept  # its old bytes all written over (checked in message())
    view = memoryview(second.data)
    second.free()
    assert spares.held < length  # a view is alive: not kept
    third = message(3)
    assert id(third.data) != kept and bytes(view[1:4]) == b"\x02\x02\x02"  # the viewed bytes untouched
    del view
    third.free()
    # Nothing is kept past the limit, nor a buffer below the smallest size worth keeping.
    small = SpareBuffers(length)
    small.give(bytearray(length))
    small.give(bytearray(length))
    small.give(bytearray(100))
    assert small.held == length
    assert small.take(length + 1, 2 * length) is None and small.take(length, length) is not None
    assert small.held == 0 and small.take(1, 1 << 30) is None


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_message"):
        H2Limits(max_message=0)
    with pytest.raises(ConfigError, match="idle_timeout_s"):
        H2Limits(idle_timeout_s=-1)


def test_a_budget_allows_its_burst_then_its_rate() -> None:
    budget = Budget(3, 1000.0)
    assert all(budget.spend() for _ in range(3))
    assert not budget.spend()
    time.sleep(0.01)  # 10 ms at 1000 a second: about 10 tokens, capped at the burst
    assert budget.spend()


def test_a_header_block_over_the_limit_is_refused_before_it_is_read(server, caplog) -> None:
    listener = server(limits=H2Limits(max_header_block=4096))
    with caplog.at_level(logging.WARNING), _connect(listener) as sock:
        # Only the frame's head is sent: the server refuses on the announced length alone.
        sock.sendall(frame_header(4 * 1024 * 1024, HEADERS, END_HEADERS, 1))
        frames = h2_frames_until_closed(sock)
    assert _goaway_code(frames) == ENHANCE_YOUR_CALM
    # The replica's log says why the connection ended.
    said = "GOAWAY 11: a header block over 4096 bytes"
    assert wait_for(lambda: any(said in r.getMessage() for r in caplog.records))
    settings = next(payload for kind, _, payload in frames if kind == SETTINGS)
    announced = dict(struct.unpack(">HI", settings[i : i + 6]) for i in range(0, len(settings), 6))
    assert announced[6] == 4096  # SETTINGS_MAX_HEADER_LIST_SIZE


def test_a_ping_flood_ends_with_enhance_your_calm_and_a_few_pings_do_not(server) -> None:
    listener = server(limits=H2Limits(glitch_burst=50, glitch_rate=1.0))
    ping = frame_header(8, PING, 0, 0) + b"12345678"
    with _connect(listener) as sock:
        sock.sendall(ping * 20 + _request(1, b"ok"))
        sock.settimeout(5)
        data = b""
        while b"ok" not in data:  # answered: 20 pings are within the budget
            got = sock.recv(65536)
            assert got
            data += got
        sock.sendall(ping * 100)
        frames = h2_frames_until_closed(sock)
    assert _goaway_code(frames) == ENHANCE_YOUR_CALM
    assert b"PING" in next(payload for kind, _, payload in frames if kind == GOAWAY)


def test_an_idle_connection_gets_goaway_and_is_closed(server) -> None:
    listener = server(limits=H2Limits(idle_timeout_s=0.5))
    with _connect(listener) as sock:
        started = time.monotonic()
        frames = h2_frames_until_closed(sock)
        waited = time.monotonic() - started
    assert _goaway_code(frames) == NO_ERROR
    assert 0.4 < waited < 4
    assert wait_for(lambda: not listener.open_connections(), 5)


def test_a_client_that_never_finishes_its_preface_is_closed(server) -> None:
    listener = server(limits=H2Limits(preface_timeout_s=0.5))
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.sendall(PREFACE[:10])
        started = time.monotonic()
        assert h2_frames_until_closed(sock) == []
        assert time.monotonic() - started < 4


def test_a_call_reset_before_it_runs_is_never_run(server) -> None:
    release = threading.Event()
    ran: list[bytes] = []

    def handler(call: Call) -> None:
        message = bytes(call.request())
        ran.append(message)
        if message == b"first":
            release.wait(10)
        call.respond([message])

    listener = server(handler, threads=1)
    with _connect(listener) as sock:
        # Stream 1 takes the only worker; stream 3 waits for it and is reset meanwhile.
        reset = frame_header(4, RST_STREAM, 0, 3) + (8).to_bytes(4, "big")  # CANCEL
        sock.sendall(_request(1, b"first") + _request(3, b"second") + reset)
        assert wait_for(lambda: ran, 5)
        time.sleep(0.2)  # the reader has read the reset by now
        release.set()
        sock.settimeout(5)
        data = b""
        while b"first" not in data:
            got = sock.recv(65536)
            assert got
            data += got
        time.sleep(0.2)
    assert ran == [b"first"]


def test_hundreds_of_idle_connections_cost_no_thread_and_lock_no_caller_out(server) -> None:
    listener = server(max_connections=4)
    before = threading.active_count()
    idle = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", listener.port))
            if i % 2:  # half of them say hello first, then fall silent
                sock.sendall(PREFACE + frame_header(0, SETTINGS, 0, 0))
            idle.append(sock)
        assert wait_for(lambda: len(listener.open_connections()) == 300, 10)
        time.sleep(0.3)
        assert threading.active_count() - before <= 8  # the workers, not a thread per socket
        with _connect(listener) as sock:
            sock.sendall(_request(1, b"still served"))
            sock.settimeout(5)
            data = b""
            while b"still served" not in data:
                got = sock.recv(65536)
                assert got
                data += got
    finally:
        for sock in idle:
            sock.close()
    assert wait_for(lambda: not listener.open_connections(), 10)


def test_a_byte_budget_and_its_parent_refuse_past_their_limits() -> None:
    listener = ByteBudget(100, "the listener's")
    a = ByteBudget(60, "a's", listener)
    b = ByteBudget(60, "b's", listener)
    a.take(60)
    with pytest.raises(OverBudget, match="a's"):
        a.take(1)
    with pytest.raises(OverBudget, match="the listener's"):
        b.take(41)
    assert (a.used, b.used, listener.used) == (60, 0, 60)  # a refused take takes nothing
    b.take(40)
    a.give(60)
    b.give(40)
    assert (a.used, b.used, listener.used) == (0, 0, 0)


def test_messages_past_the_memory_budget_are_refused_and_their_memory_comes_back(server) -> None:
    """Three messages that together would hold more than the connection's budget: the third is
    refused with RESOURCE_EXHAUSTED as its bytes arrive, the others are answered, and every byte
    taken from the budget is given back."""
    limits = H2Limits(max_connection_bytes=600_000)
    listener = server(lambda call: call.respond([bytes(call.request())[:10]]), limits=limits)
    part = b"x" * 250_000
    with _connect(listener) as sock:
        # Whole messages, but their streams stay open (no END_STREAM): their buffers are held.
        for stream_id in (1, 3, 5):
            sock.sendall(_request(stream_id, part, end=False))
        sock.settimeout(10)
        data, frames = b"", []
        while not any(kind == HEADERS and stream == 5 for kind, stream, _ in frames):
            got = sock.recv(65536)
            assert got
            data += got
            frames = h2_whole_frames(data)
        assert listener.budget.used <= 600_000
        sock.sendall(frame_header(0, DATA, END_STREAM, 1) + frame_header(0, DATA, END_STREAM, 3))
        while sum(kind == HEADERS for kind, _, _ in frames) < 5:  # 1 and 3: headers and trailers
            got = sock.recv(65536)
            assert got
            data += got
            frames = h2_whole_frames(data)
    decoder = hpack.Decoder()
    statuses = {}
    for kind, stream, payload in frames:
        if kind == HEADERS:
            for name, value in decoder.decode(payload):
                if name == "grpc-status":
                    statuses[stream] = value
    assert statuses == {1: "0", 3: "0", 5: "8"}  # 8: RESOURCE_EXHAUSTED
    assert wait_for(lambda: listener.budget.used == 0)


@pytest.mark.parametrize("kind", [PING, RST_STREAM, SETTINGS, 8])  # 8: WINDOW_UPDATE
def test_a_control_frame_announcing_megabytes_is_refused_from_its_head(server, kind: int) -> None:
    listener = server()
    with _connect(listener) as sock:
        sock.sendall(frame_header(8 * 1024 * 1024, kind, 0, 1 if kind == RST_STREAM else 0))
        frames = h2_frames_until_closed(sock)  # refused before any of the payload is sent
    assert _goaway_code(frames) in (6, ENHANCE_YOUR_CALM)  # FRAME_SIZE_ERROR, or too large a SETTINGS


@pytest.mark.parametrize(
    ("increments", "code"),
    # A zero increment: PROTOCOL_ERROR (1); a window past 2^31-1: FLOW_CONTROL_ERROR (3).
    [([0], 1), ([2**31 - 1, 2**31 - 1], 3)],
)
def test_a_bad_window_update_resets_its_stream_and_the_connection_goes_on(
    server, increments, code, grpc_engine
) -> None:
    release = threading.Event()

    def handler(call: Call) -> None:
        message = bytes(call.request())
        if message == b"wait":
            release.wait(10)
        call.respond([message])

    listener = server(handler, threads=2)
    with _connect(listener) as sock:
        updates = b"".join(frame_header(4, 8, 0, 1) + n.to_bytes(4, "big") for n in increments)
        sock.sendall(_request(1, b"wait") + updates + _request(3, b"next"))
        if grpc_engine == "nghttp2" and increments == [0]:
            # nghttp2 ends the connection for a zero increment (RFC 9113 5.4: a stream error
            # may be treated as a connection error)
            frames = h2_frames_until_closed(sock)
            release.set()
            assert _goaway_code(frames) == PROTOCOL_ERROR
            return
        sock.settimeout(10)
        data, frames = b"", []
        while not any(kind == RST_STREAM and stream == 1 for kind, stream, _ in frames) or not any(
            kind == HEADERS and stream == 3 for kind, stream, _ in frames
        ):
            got = sock.recv(65536)
            assert got, "the server closed the connection"
            data += got
            frames = h2_whole_frames(data)
        release.set()
    reset = next(payload for kind, stream, payload in frames if kind == RST_STREAM and stream == 1)
    assert int.from_bytes(reset, "big") == code
    assert not any(kind == GOAWAY for kind, _, _ in frames)


def test_streams_past_max_streams_are_refused_and_the_limit_is_announced(server) -> None:
    """``max_streams`` is announced as SETTINGS_MAX_CONCURRENT_STREAMS; a stream opened past it is
    reset with REFUSED_STREAM and the others are answered."""
    release = threading.Event()

    def handler(call: Call) -> None:
        release.wait(10)
        call.respond([bytes(call.request())])

    listener = server(handler, limits=H2Limits(max_streams=2))
    # A client that has not taken the server's settings yet: its stream past the limit is refused
    # (nghttp2 ends the connection of one that has: it knew the limit).
    with _connect(listener, ack=False) as sock:
        sock.sendall(_request(1, b"a") + _request(3, b"b") + _request(5, b"c"))
        data = b""
        sock.settimeout(5)
        while not any(kind == RST_STREAM for kind, _, _ in h2_whole_frames(data)):
            got = sock.recv(65536)
            assert got, "the server closed the connection"
            data += got
        release.set()
        while sum(kind == HEADERS for kind, _, _ in h2_whole_frames(data)) < 4:  # 2 answers, 2 trailers
            got = sock.recv(65536)
            assert got, "the server closed the connection"
            data += got
    frames = h2_whole_frames(data)
    settings = next(payload for kind, _, payload in frames if kind == SETTINGS and payload)
    announced = dict(struct.unpack(">HI", settings[i : i + 6]) for i in range(0, len(settings), 6))
    assert announced[3] == 2  # SETTINGS_MAX_CONCURRENT_STREAMS
    resets = [(stream, int.from_bytes(code, "big")) for kind, stream, code in frames if kind == RST_STREAM]
    assert resets == [(5, 7)]  # REFUSED_STREAM
    answered = {stream for kind, stream, _ in frames if kind == DATA}
    assert answered == {1, 3}
