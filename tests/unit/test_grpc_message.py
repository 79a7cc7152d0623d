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
import pytest

from ray_triton_shm._private.serve.http2.grpc_message import HEAD_BYTES, Placement
from ray_triton_shm._private.serve.http2.h2_listener import H2Listener
from ray_triton_shm._private.serve.http2.h2_reader import FrameReader
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PREFACE,
    READ_AHEAD,
    RST_STREAM,
    SETTING,
    SETTINGS,
    WINDOW_UPDATE,
    H2Limits,
    frame_header,
)
from tests.helpers import h2_request_block, h2_whole_frames, wait_for

pytestmark = pytest.mark.usefixtures("grpc_engine")  # each test on each engine

HEAD = b"HEAD"
TWO = b"TWO:"
KEY = b"\x3a\x07"


class Leases:
    """Leases of a pretend pool: how many were taken and how many given back."""

    def __init__(self) -> None:
        self.taken = 0
        self.released = 0
        self.busy = False  # whether other calls wait for a slot
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


def _placed_listener(**options) -> tuple[H2Listener, Leases]:
    """A listener whose ``/pkg.Svc/Put`` messages are placed (``HEAD KEY body``, or ``TWO KEY
    first KEY rest`` with 8000 bytes first); answers ``placed:`` + body or ``buffer:`` + message."""
    leases = Leases()

    def placer(head: bytes, length: int) -> Placement | None:
        if not head.startswith((HEAD, TWO)):
            return None
        body = length - len(HEAD) - len(KEY)
        if head.startswith(HEAD):
            target = bytearray(body)
            return Placement(leases.lease(), HEAD, [KEY, memoryview(target)], target, lambda: leases.busy)
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
        "127.0.0.1",
        0,
        handler,
        place=lambda method: placer if method == "/pkg.Svc/Put" else None,
        **options,
    )
    return listener, leases


@pytest.fixture
def placed():
    listeners = []

    def start(**options) -> tuple[H2Listener, Leases]:
        listeners.append(_placed_listener(**options))
        return listeners[-1]

    yield start
    for listener, leases in listeners:
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
    listener, leases = placed()
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    assert _put(listener, HEAD + KEY + body) == b"placed:" + body
    assert leases.taken == 1


def test_unexpected_bytes_turn_the_message_back_into_a_buffer_as_sent(placed) -> None:
    listener, leases = placed()
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


def _start_put(sock: socket.socket, body_sent: bytes, total: int) -> None:
    """Open stream 1 of ``/pkg.Svc/Put`` and send the first ``body_sent`` bytes of a message of ``total``."""
    block = h2_request_block("/pkg.Svc/Put")
    message = b"\x00" + total.to_bytes(4, "big") + body_sent
    sock.sendall(
        PREFACE
        + frame_header(0, SETTINGS, 0, 0)
        + frame_header(0, SETTINGS, ACK, 0)  # the server's settings taken, as every real client does
        + frame_header(len(block), HEADERS, END_HEADERS, 1)
        + block
        + frame_header(len(message), DATA, 0, 1)
        + message
    )


def test_a_stream_reset_mid_message_gives_the_slot_back(placed) -> None:
    listener, leases = placed()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, len(HEAD + KEY) + 100_000)
        assert wait_for(lambda: leases.taken == 1)
        assert leases.out() == 1  # held while the rest arrives
        sock.sendall(frame_header(4, RST_STREAM, 0, 1) + (8).to_bytes(4, "big"))  # CANCEL
        assert wait_for(lambda: leases.out() == 0)
        assert _put(listener, HEAD + KEY + b"after") == b"placed:after"  # the server goes on


def test_a_connection_closed_mid_message_gives_the_slot_back(placed) -> None:
    listener, leases = placed()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, len(HEAD + KEY) + 100_000)
        assert wait_for(lambda: leases.taken == 1)
    assert wait_for(lambda: leases.out() == 0)


def test_a_client_that_stalls_mid_message_gives_the_slot_back_and_is_still_answered(placed) -> None:
    listener, leases = placed(limits=H2Limits(slot_stall_s=0.5))
    total = len(HEAD + KEY) + 100_000
    first = HEAD + KEY + b"a" * 5000
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, first, total)
        assert wait_for(lambda: leases.taken == 1)
        started = time.monotonic()
        assert wait_for(lambda: leases.out() == 0, 10)  # back while the client still holds the call
        assert 0.3 < time.monotonic() - started < 5
        # The rest of the message, late: read into memory and answered as any other message.
        rest = b"b" * (total - len(first))
        windows = (
            frame_header(6, SETTINGS, 0, 0)
            + SETTING.pack(INITIAL_WINDOW_SIZE, 1 << 30)
            + frame_header(4, WINDOW_UPDATE, 0, 0)
            + (1 << 30).to_bytes(4, "big")
        )
        sock.sendall(windows + frame_header(len(rest), DATA, END_STREAM, 1) + rest)
        sock.settimeout(10)
        data, tail = b"", (first + rest)[-1000:]
        while tail not in data:
            got = sock.recv(1 << 20)
            assert got, "the server closed the connection"
            data += got
        assert b"buffer:" + first[:100] in data
    assert leases.taken == 1
    # Idle connections between calls are not timed out by the stall time: only slots are.
    with grpc.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
        put = channel.unary_unary("/pkg.Svc/Put")
        assert put(HEAD + KEY + b"1", timeout=10) == b"placed:1"
        time.sleep(1.0)
        assert put(HEAD + KEY + b"2", timeout=10) == b"placed:2"


def test_a_client_that_trickles_does_not_keep_the_slot(placed) -> None:
    """A byte every 0.2 s never lets a read wait the whole stall time, yet the slot goes back."""
    listener, leases = placed(limits=H2Limits(slot_stall_s=0.5))
    total = len(HEAD + KEY) + 100_000
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, total)
        assert wait_for(lambda: leases.taken == 1)
        started = time.monotonic()
        while leases.out() and time.monotonic() - started < 10:
            sock.sendall(frame_header(1, DATA, 0, 1) + b"t")
            time.sleep(0.2)
        assert leases.out() == 0 and time.monotonic() - started < 5


@pytest.mark.parametrize("pace", ["trickled frames", "a stalled frame"])
def test_once_others_wait_for_a_slot_a_slow_message_keeps_it_only_the_busy_stall_time(
    placed, pace: str
) -> None:
    """A message arriving slowly keeps its slot the stall time (long here) while no one else waits
    for one; once another call waits, the busy stall time: looked at as the read waits, whether
    between frames or inside one."""
    listener, leases = placed(limits=H2Limits(slot_stall_s=30.0, slot_busy_stall_s=0.2))
    total = len(HEAD + KEY) + 100_000
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        _start_put(sock, HEAD + KEY + b"a" * 5000, total)
        assert wait_for(lambda: leases.taken == 1)
        if pace == "a stalled frame":  # a frame of 50,000 bytes, 1,000 of them sent
            sock.sendall(frame_header(50_000, DATA, 0, 1) + b"s" * 1000)
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            if pace == "trickled frames":
                sock.sendall(frame_header(1, DATA, 0, 1) + b"t")
            time.sleep(0.1)
        assert leases.out() == 1  # nobody else waits: kept, the client being within its stall time
        leases.busy = True
        busy_at = time.monotonic()
        while leases.out() and time.monotonic() - busy_at < 10:
            if pace == "trickled frames":
                sock.sendall(frame_header(1, DATA, 0, 1) + b"t")
            time.sleep(0.05)
        assert leases.out() == 0 and time.monotonic() - busy_at < 2


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


def test_an_answer_the_client_does_not_take_leaves_the_slot_and_still_arrives_whole(grpc_engine) -> None:
    """A client that opens no window for the answer: the answer is copied out, the slot released."""
    leases = Leases()
    answer = bytes(range(256)) * 4096  # 1 MiB: far over the client's 64 KiB window
    sent = threading.Event()

    def handler(call: Call) -> None:
        lease = leases.lease()
        parts: list[bytes | memoryview] = [memoryview(answer)]
        try:
            call.respond(parts, lease.release)
        finally:
            lease.release()
            sent.set()

    listener = H2Listener("127.0.0.1", 0, handler, limits=H2Limits(slot_stall_s=0.5))
    try:
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            block = h2_request_block("/pkg.Svc/Any")
            message = b"\x00" + (1).to_bytes(4, "big") + b"q"
            sock.sendall(
                PREFACE
                + frame_header(0, SETTINGS, 0, 0)
                + frame_header(len(block), HEADERS, END_HEADERS, 1)
                + block
                + frame_header(len(message), DATA, END_STREAM, 1)
                + message
            )
            assert wait_for(lambda: leases.taken == 1)
            started = time.monotonic()
            assert wait_for(lambda: leases.out() == 0, 10)  # released while the answer waits
            assert 0.3 < time.monotonic() - started < 5
            # The Python engine's worker still sends from the copy; nghttp2's answers from it
            # without a thread, and the call returned once its parts were copied.
            assert sent.is_set() == (grpc_engine == "nghttp2")
            sock.sendall(
                frame_header(6, SETTINGS, 0, 0)
                + SETTING.pack(INITIAL_WINDOW_SIZE, 1 << 30)
                + frame_header(4, WINDOW_UPDATE, 0, 0)
                + (1 << 30).to_bytes(4, "big")
            )
            sock.settimeout(10)
            data, payload = b"", b""
            while len(payload) < len(answer) + 5:
                got = sock.recv(1 << 20)
                assert got, "the server closed the connection"
                data += got
                payload = b"".join(p for kind, _, p in h2_whole_frames(data) if kind == DATA)
            assert payload == b"\x00" + len(answer).to_bytes(4, "big") + answer
            assert sent.wait(5)
    finally:
        listener.close()


@pytest.mark.parametrize("thread", ["reader", "worker"])
def test_a_slots_answer_gives_the_slot_back_before_its_status_is_sent(thread: str) -> None:
    """The client, once it has the status, may call again at once: the slot is free by then.

    ``reader``: the connection's only call runs in its reader thread; ``worker``: another
    stream is open, so the call runs in a worker thread.
    """
    leases = Leases()
    answer = bytes(range(256)) * 16
    out_at_status: list[int] = []

    def handler(call: Call) -> None:
        lease = leases.lease()
        try:
            call.respond([memoryview(answer)], lease.release)
            time.sleep(0.5)  # the call's own way back (the client has its status by now)
        finally:
            lease.release()

    listener = H2Listener("127.0.0.1", 0, handler)
    try:
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            block = h2_request_block("/pkg.Svc/Any")
            message = b"\x00" + (1).to_bytes(4, "big") + b"q"
            other = frame_header(len(block), HEADERS, END_HEADERS, 1) + block if thread == "worker" else b""
            sid = 3 if thread == "worker" else 1
            sock.sendall(
                PREFACE
                + frame_header(0, SETTINGS, 0, 0)
                + other
                + frame_header(len(block), HEADERS, END_HEADERS, sid)
                + block
                + frame_header(len(message), DATA, END_STREAM, sid)
                + message
            )
            sock.settimeout(10)
            data, payload = b"", b""
            while not out_at_status:
                got = sock.recv(1 << 16)
                assert got, "the server closed the connection"
                data += got
                for kind, stream_id, body in h2_whole_frames(data):
                    if kind == DATA and stream_id == sid:
                        payload += body
                    if kind == HEADERS and stream_id == sid and payload:  # the status, after the message
                        out_at_status.append(leases.out())
                if not out_at_status:
                    payload = b""
            assert payload == b"\x00" + len(answer).to_bytes(4, "big") + answer
            assert out_at_status == [0]
    finally:
        listener.close()


class _Slot:
    """The one slot of a pretend pool."""

    def __init__(self) -> None:
        self._free = threading.Condition()
        self.held = False

    def acquire(self, timeout: float = 0.0) -> bool:
        with self._free:
            if not self._free.wait_for(lambda: not self.held, timeout):
                return False
            self.held = True
            return True

    def release(self) -> None:
        with self._free:
            self.held = False
            self._free.notify()


class _OneRelease:
    """A lease of the one slot: its release gives the slot back once."""

    def __init__(self, slot: _Slot) -> None:
        self._slot = slot
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._slot.release()


def _one_slot_listener(**options) -> tuple[H2Listener, _Slot]:
    """A listener with one slot: ``HEAD KEY body`` messages are placed in it when it is free; any
    other call waits up to 20 s for it (answered ``waited``), or is answered ``no slot``."""
    slot = _Slot()

    def placer(head: bytes, length: int) -> Placement | None:
        if not head.startswith(HEAD) or not slot.acquire():
            return None
        target = bytearray(length - len(HEAD) - len(KEY))
        return Placement(_OneRelease(slot), HEAD, [KEY, memoryview(target)], target)

    def handler(call: Call) -> None:
        placement = call.placement()
        if placement is not None:
            placement.release()
            call.respond([b"placed"])
        elif slot.acquire(timeout=20):
            slot.release()
            call.respond([b"waited"])
        else:
            call.respond([b"no slot"])

    place = lambda method: placer if method == "/pkg.Svc/Put" else None  # noqa: E731
    return H2Listener("127.0.0.1", 0, handler, place=place, **options), slot


def _call_frames(stream_id: int, message: bytes, end: bool = True) -> bytes:
    block = h2_request_block("/pkg.Svc/Put")
    return (
        frame_header(len(block), HEADERS, END_HEADERS, stream_id)
        + block
        + frame_header(len(message), DATA, END_STREAM if end else 0, stream_id)
        + message
    )


def _answers(sock: socket.socket, streams: int, timeout_s: float) -> dict[int, bytes]:
    """The answer message of each of ``streams`` streams (those that arrive within ``timeout_s``)."""
    sock.settimeout(0.2)
    data, deadline, answers = b"", time.monotonic() + timeout_s, {}
    while len(answers) < streams and time.monotonic() < deadline:
        try:
            got = sock.recv(1 << 20)
        except TimeoutError:
            continue
        assert got, "the server closed the connection"
        data += got
        bodies: dict[int, bytes] = {}
        for kind, stream_id, payload in h2_whole_frames(data):
            if kind == DATA and stream_id:
                bodies[stream_id] = bodies.get(stream_id, b"") + payload
        whole = {k: v for k, v in bodies.items() if len(v) == 5 + int.from_bytes(v[1:5] or b"\xff", "big")}
        answers = {k: v[5:] for k, v in whole.items()}
    return answers


@pytest.mark.parametrize("others", [1, 2], ids=["one-call-waiting", "calls-waiting-on-every-thread"])
def test_a_call_waiting_for_a_slot_never_blocks_the_call_that_holds_it(others: int) -> None:
    """Stream 1's message is placed in the only slot and still arriving; ``others`` calls whose
    messages are in memory wait for a slot. Neither the connection's reader (one waiting call
    could run in it) nor the one worker thread (taken by the first waiting call) may be held by a
    waiting call: the rest of stream 1 is read, its call runs, and its slot then serves the others."""
    listener, slot = _one_slot_listener(threads=1)
    total = len(HEAD + KEY) + 100_000
    first = HEAD + KEY + b"a" * 5000
    try:
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            sock.sendall(PREFACE + frame_header(0, SETTINGS, 0, 0) + frame_header(0, SETTINGS, ACK, 0))
            sock.sendall(_call_frames(1, b"\x00" + total.to_bytes(4, "big") + first, end=False))
            assert wait_for(lambda: slot.held)  # stream 1 holds the slot
            waiting = b"".join(
                _call_frames(3 + 2 * i, b"\x00" + (7).to_bytes(4, "big") + b"other:7") for i in range(others)
            )
            sock.sendall(waiting)
            time.sleep(0.3)  # the waiting calls are dispatched
            sock.sendall(frame_header(total - len(first), DATA, END_STREAM, 1) + b"b" * (total - len(first)))
            answers = _answers(sock, 1 + others, timeout_s=10)
        assert answers == {1: b"placed", **{3 + 2 * i: b"waited" for i in range(others)}}
        assert not slot.held
    finally:
        listener.close()
