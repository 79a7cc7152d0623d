"""Request messages read into place: the HTTP/2 server with a placer, against grpcio's client and raw sockets.

The placer here puts the body of messages shaped ``HEAD + KEY + body`` into a
buffer of its own, leased from a counter of its own: what is checked is where
the bytes go and that every lease comes back, whatever the client does.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import hpack
import pytest

from ray_triton_shm._private.serve.door.frontdoor_grpc import H2Listener
from ray_triton_shm._private.serve.http2 import grpc_h2
from ray_triton_shm._private.serve.http2.grpc_message import HEAD_BYTES, Placement
from ray_triton_shm._private.serve.http2.h2_wire import (
    DATA,
    END_HEADERS,
    HEADERS,
    PREFACE,
    READ_AHEAD,
    RST_STREAM,
    SETTINGS,
    Call,
    FrameReader,
    frame_header,
)
from tests.helpers import wait_for

HEAD = b"HEAD"
TWO = b"TWO:"
KEY = b"\x3a\x07"


class Leases:
    """Leases of a pretend pool: how many were taken and how many given back."""

    def __init__(self) -> None:
        self.taken = 0
        self.released = 0
        self.lock = threading.Lock()

    def lease(self) -> _Lease:
        with self.lock:
            self.taken += 1
        return _Lease(self)

    def out(self) -> int:
        with self.lock:
            return self.taken - self.released


class _Joined:
    def __init__(self, *parts: bytearray) -> None:
        self.parts = parts

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


class _Lease:
    def __init__(self, leases: Leases) -> None:
        self._leases = leases
        self._released = False

    def release(self) -> None:
        with self._leases.lock:
            if not self._released:
                self._released = True
                self._leases.released += 1


@pytest.fixture
def placed():
    """A listener whose ``/pkg.Svc/Put`` messages are placed (``HEAD KEY body``, or ``TWO KEY
    first KEY rest`` with 8000 bytes first); answers ``placed:`` + body or ``buffer:`` + message."""
    leases = Leases()

    def placer(head: bytes, length: int) -> Placement | None:
        if not head.startswith((HEAD, TWO)):
            return None
        body = length - len(HEAD) - len(KEY)
        if head.startswith(HEAD):
            target = bytearray(body)
            return Placement(leases.lease(), HEAD, [KEY, memoryview(target)], target)
        first, rest = bytearray(8000), bytearray(body - 8000 - len(KEY))
        parts = [KEY, memoryview(first), KEY, memoryview(rest)]
        return Placement(leases.lease(), TWO, parts, _Joined(first, rest))

    def handler(call: Call) -> None:
        placement = call.placement()
        if placement is None:
            call.respond([b"buffer:", bytes(call.request())])
            return
        body = bytes(placement.request)
        placement.release()
        call.respond([b"placed:", body])

    listener = H2Listener(
        "127.0.0.1", 0, handler, place=lambda method: placer if method == "/pkg.Svc/Put" else None
    )
    yield listener, leases
    listener.close()
    assert not listener.open_connections()
    assert leases.out() == 0, "a lease was not given back"


def _put(listener: H2Listener, data: bytes, method: str = "/pkg.Svc/Put", **options) -> bytes:
    with grpc.insecure_channel(
        f"127.0.0.1:{listener.port}",
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    ) as channel:
        return channel.unary_unary(method)(data, timeout=30, **options)


@pytest.mark.parametrize("size", [1, 100, HEAD_BYTES, 3 << 20])
def test_the_body_is_read_into_place(placed, size: int) -> None:
    listener, leases = placed
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    assert _put(listener, HEAD + KEY + body) == b"placed:" + body
    assert leases.taken == 1


def test_unexpected_bytes_turn_the_message_back_into_a_buffer_as_sent(placed) -> None:
    listener, leases = placed
    body = bytes(range(256)) * 100
    assert _put(listener, TWO + KEY + body[:8000] + KEY + body[8000:]) == b"placed:" + body
    for message in (
        HEAD + b"\x3a\x08" + b"x" * 5000,  # the first key differs (within the head)
        TWO + KEY + body[:8000] + b"\x3a\x09" + body[8000:],  # the second key differs (read later)
        b"other" + b"x" * 70_000,  # the placer says no
    ):
        assert _put(listener, message) == b"buffer:" + message
    compressed = HEAD + KEY + b"y" * 10_000  # compressed messages are never placed
    assert _put(listener, compressed, compression=grpc.Compression.Gzip) == b"buffer:" + compressed
    other = HEAD + KEY + b"q" * 10
    assert _put(listener, other, method="/pkg.Svc/Other") == b"buffer:" + other
    assert leases.taken == 3 and leases.out() == 0


def _request_block(path: str) -> bytes:
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x")]
    return hpack.Encoder().encode([*headers, ("content-type", "application/grpc"), ("te", "trailers")])


def _start_put(sock: socket.socket, body_sent: bytes, total: int) -> None:
    """Open stream 1 of ``/pkg.Svc/Put`` and send the first ``body_sent`` bytes of a message of ``total``."""
    block = _request_block("/pkg.Svc/Put")
    message = b"\x00" + total.to_bytes(4, "big") + body_sent
    sock.sendall(
        PREFACE
        + frame_header(0, SETTINGS, 0, 0)
        + frame_header(len(block), HEADERS, END_HEADERS, 1)
        + block
        + frame_header(len(message), DATA, 0, 1)
        + message
    )


def test_a_stream_reset_mid_message_gives_the_slot_back(placed) -> None:
    listener, leases = placed
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, len(HEAD + KEY) + 100_000)
        assert wait_for(lambda: leases.taken == 1)
        assert leases.out() == 1  # held while the rest arrives
        sock.sendall(frame_header(4, RST_STREAM, 0, 1) + (8).to_bytes(4, "big"))  # CANCEL
        assert wait_for(lambda: leases.out() == 0)
        assert _put(listener, HEAD + KEY + b"after") == b"placed:after"  # the server goes on


def test_a_connection_closed_mid_message_gives_the_slot_back(placed) -> None:
    listener, leases = placed
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, len(HEAD + KEY) + 100_000)
        assert wait_for(lambda: leases.taken == 1)
    assert wait_for(lambda: leases.out() == 0)


def test_a_client_that_stalls_mid_message_loses_its_connection_and_the_slot(placed, monkeypatch) -> None:
    listener, leases = placed
    monkeypatch.setattr(grpc_h2, "PLACED_READ_TIMEOUT_S", 1.0)
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, len(HEAD + KEY) + 100_000)
        assert wait_for(lambda: leases.taken == 1)
        started = time.monotonic()
        assert wait_for(lambda: leases.out() == 0, 10)
        assert 0.8 < time.monotonic() - started < 5
        sock.settimeout(5)
        closed = False
        while not closed:  # the server's settings, then the end of the connection
            closed = not sock.recv(65536)
    # Idle connections between calls are not timed out: only a message being placed is.
    with grpc.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
        put = channel.unary_unary("/pkg.Svc/Put")
        assert put(HEAD + KEY + b"1", timeout=10) == b"placed:1"
        time.sleep(1.5)
        assert put(HEAD + KEY + b"2", timeout=10) == b"placed:2"


def test_a_frame_head_reads_little_of_the_payload_behind_it() -> None:
    """The bytes behind a frame's head mostly go from the socket straight to their target."""
    a, b = socket.socketpair()
    try:
        payload = bytes(range(256)) * 4096  # 1 MB
        a.sendall(frame_header(len(payload), DATA, 0, 1))
        sender = threading.Thread(target=a.sendall, args=(payload,))
        sender.start()
        time.sleep(0.2)  # the payload waits in the socket when the head is read
        reader = FrameReader(b)
        assert reader.exactly(9)[:3] == len(payload).to_bytes(3, "big")
        assert reader.buffered() <= READ_AHEAD
        target = bytearray(len(payload))
        reader.into(memoryview(target))
        sender.join()
        assert target == payload
        assert reader.buffered() == 0
    finally:
        a.close()
        b.close()
