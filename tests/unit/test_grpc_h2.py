"""The front door's HTTP/2 gRPC server, spoken to by grpcio's own client (and by hand, for bad input)."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time

import grpc
import hpack
import pytest

from ray_triton_shm._private.serve.http2.h2_listener import H2Listener
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    WINDOW_UPDATE,
    CallError,
    H2Limits,
    frame_header,
    percent_encode,
)
from ray_triton_shm._private.serve.net.bounded import SpareBuffers
from tests.helpers import h2_frames_until_closed, h2_request_block, wait_for

pytestmark = pytest.mark.usefixtures("grpc_engine")  # each test on each engine


def _echo(call: Call) -> None:
    """Answers the request's bytes, reversed in two parts, with the metadata's ``x-tag`` first."""
    data = bytes(call.request())
    tag = dict(call.metadata).get("x-tag", "").encode()
    call.respond([tag, memoryview(data[::-1])])


@pytest.fixture
def server():
    listeners = []

    def start(handler=_echo, **options):
        listener = H2Listener("127.0.0.1", 0, handler, **options)
        listeners.append(listener)
        return listener

    yield start
    for listener in listeners:
        listener.close()
        assert not listener.open_connections()


def _method(listener: H2Listener, name: str = "/pkg.Svc/Echo", **options):
    channel = grpc.insecure_channel(
        f"127.0.0.1:{listener.port}",
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        **options,
    )
    return channel, channel.unary_unary(name)


def test_unary_calls_small_and_larger_than_every_window_are_answered_whole(server) -> None:
    listener = server()
    channel, echo = _method(listener)
    with channel:
        assert echo(b"abc", metadata=[("x-tag", "t:")]) == b"t:cba"
        assert echo(b"") == b""
        big = bytes(range(256)) * (48 * 1024)  # 12 MiB: more than the client's 4 MiB window
        assert echo(big) == big[::-1]


def test_concurrent_calls_on_one_connection_each_get_their_own_answer(server) -> None:
    listener = server(threads=4)
    channel, echo = _method(listener)
    answers: dict[int, bytes] = {}

    def call(i: int) -> None:
        answers[i] = echo(str(i).encode() * 50_000)

    with channel:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert answers == {i: (str(i).encode() * 50_000)[::-1] for i in range(16)}
    assert len(listener.open_connections()) <= 1


def test_a_message_read_into_memory_reuses_a_finished_ones_buffer_unless_a_view_of_it_lives(server) -> None:
    """The buffer a finished message was read into is taken by the next message of its size (its
    pages are mapped already), each message reading its own bytes into it; a buffer the handler
    still views is not reused."""

    class Recorded(SpareBuffers):
        """The sizes of the buffers kept, and of the kept ones taken."""

        def __init__(self, limit: int) -> None:
            super().__init__(limit)
            self.kept: list[int] = []
            self.taken: list[int] = []

        def keep(self, buffer: bytearray) -> None:
            self.kept.append(len(buffer))
            super().keep(buffer)

        def take(self, low: int, high: int) -> bytearray | None:
            found = super().take(low, high)
            if found is not None:
                self.taken.append(len(found))
            return found

    kept: list[memoryview] = []

    def handler(call: Call) -> None:
        data = call.request()
        if not kept and data[0] == 2:
            kept.append(memoryview(data))  # outlives the call
        call.respond([hashlib.sha256(data).digest()])

    listener = server(handler)
    spares = listener.budget.spares = Recorded(listener.budget.spares.limit)  # before any connection
    channel, digest = _method(listener)
    size = 300_000
    messages = [bytes([i]) * size for i in (1, 2, 3)]
    with channel:
        assert digest(messages[0]) == hashlib.sha256(messages[0]).digest()
        assert size not in spares.taken
        assert wait_for(lambda: size in spares.kept)  # given back once the call ended
        assert digest(messages[1]) == hashlib.sha256(messages[1]).digest()
        assert spares.taken.count(size) == 1  # the first message's buffer, its bytes all written over
        time.sleep(0.2)
        assert spares.kept.count(size) == 1  # the second one's is still viewed: not kept
        assert digest(messages[2]) == hashlib.sha256(messages[2]).digest()
        assert spares.taken.count(size) == 1  # the second one's is still viewed: not kept
    assert kept[0] == messages[1]  # and never written again


def test_a_handler_error_is_the_calls_status_with_its_message_encoded(server) -> None:
    def fail(call: Call) -> None:
        raise CallError("INVALID_ARGUMENT", "bad input: 100% wrong: ü")

    channel, method = _method(server(fail))
    with channel, pytest.raises(grpc.RpcError) as info:
        method(b"x")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "bad input: 100% wrong: ü"
    assert percent_encode("a%b\n") == "a%25b%0A"


def test_an_unexpected_exception_is_internal_and_the_server_goes_on(server) -> None:
    calls = []

    def flaky(call: Call) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        _echo(call)

    channel, method = _method(server(flaky))
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            method(b"x")
        assert info.value.code() == grpc.StatusCode.INTERNAL and "boom" in info.value.details()
        assert method(b"xy") == b"yx"


def test_a_refused_method_is_answered_from_its_headers_even_if_the_stream_never_ends(server) -> None:
    ran = []

    def refuse(method, metadata):
        if dict(metadata).get("application") == "other":
            return CallError("NOT_FOUND", "another app")
        return CallError("UNIMPLEMENTED", f"no {method}") if method.endswith("/Stream") else None

    listener = server(lambda call: ran.append(call), refuse=refuse)
    channel = grpc.insecure_channel(f"127.0.0.1:{listener.port}")
    with channel:
        stream = channel.stream_stream("/pkg.Svc/Stream")

        def forever():
            while True:
                yield b"x"
                time.sleep(0.05)

        with pytest.raises(grpc.RpcError) as info:
            list(stream(forever(), timeout=20))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert info.value.details() == "no /pkg.Svc/Stream"
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/pkg.Svc/Echo")(b"x", metadata=[("application", "other")])
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "another app"
    assert not ran


def test_a_message_over_the_limit_is_resource_exhausted(server) -> None:
    channel, echo = _method(server(limits=H2Limits(max_message=1000)))
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            echo(b"x" * 5000)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert echo(b"y" * 1000) == b"y" * 1000  # the connection still serves


def test_a_gzip_compressed_request_is_read_inflated(server) -> None:
    channel, echo = _method(server(), compression=grpc.Compression.Gzip)
    with channel:
        data = b"compress me " * 10_000
        assert echo(data) == data[::-1]


def test_a_client_that_gives_up_does_not_stop_the_server(server) -> None:
    release = threading.Event()
    finished = threading.Event()
    calls = []

    def slow(call: Call) -> None:
        calls.append(1)
        if len(calls) == 1:
            release.wait(10)
        try:
            call.respond([b"answer"])  # to a cancelled call: dropped (StreamGone, or unread by the client)
        finally:
            finished.set()

    listener = server(slow)
    channel, method = _method(listener)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            method(b"x", timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        assert finished.wait(5)
        assert method(b"y", timeout=10) == b"answer"


def test_protocol_errors_end_the_connection_with_goaway(server, grpc_engine) -> None:
    listener = server()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.sendall(PREFACE + frame_header(0, SETTINGS, 0, 0) + frame_header(4, 0, 0, 0) + b"data")
        frames = h2_frames_until_closed(sock)
    assert frames[0][0] == SETTINGS
    goaway = [payload for kind, _, payload in frames if kind == GOAWAY]
    assert goaway and struct.unpack(">II", goaway[0][:8])[1] == PROTOCOL_ERROR
    # The debug text is each engine's own (RFC 9113 gives it no form).
    assert {"python": b"DATA on stream 0", "nghttp2": b"DATA: stream_id == 0"}[grpc_engine] in goaway[0][8:]
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not HTTP/2: closed without an answer
        assert h2_frames_until_closed(sock) == []


def test_a_client_that_sets_its_header_table_size_gets_a_size_update_first(server) -> None:
    listener = server()
    request = hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/pkg.Svc/Echo"),
            (":authority", "x"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    message = b"\x00" + (3).to_bytes(4, "big") + b"abc"
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.sendall(
            PREFACE
            + frame_header(6, SETTINGS, 0, 0)
            + SETTING.pack(HEADER_TABLE_SIZE, 0)
            + frame_header(len(request), HEADERS, END_HEADERS, 1)
            + request
            + frame_header(len(message), DATA, END_STREAM, 1)
            + message
        )
        sock.settimeout(5)
        data, frames = b"", []
        while sum(kind == HEADERS for kind, _ in frames) < 2:  # the answer's headers and its trailers
            got = sock.recv(65536)
            assert got, "the server closed the connection"
            data += got
            while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                length = int.from_bytes(data[:3], "big")
                frames.append((data[3], data[9 : 9 + length]))
                data = data[9 + length :]
    blocks = [payload for kind, payload in frames if kind == HEADERS]
    assert blocks[0][:1] == b"\x20"  # a dynamic table size update to 0 opens the first block only
    assert blocks[1][:1] != b"\x20"
    decoder = hpack.Decoder()
    decoder.header_table_size = 0
    assert dict(decoder.decode(blocks[0]))[":status"] == "200"
    assert dict(decoder.decode(blocks[1]))["grpc-status"] == "0"
    assert next(payload for kind, payload in frames if kind == DATA)[5:] == b"cba"


def test_close_stops_listening_and_ends_connections(server) -> None:
    listener = server()
    channel, echo = _method(listener)
    with channel:
        assert echo(b"ab") == b"ba"
        listener.close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", listener.port), timeout=1).close()
        with pytest.raises(grpc.RpcError):
            echo(b"ab", timeout=2)


def _call_frames(stream: int, message: bytes) -> bytes:
    """A whole unary call to ``/pkg.Svc/Echo`` on ``stream``: its HEADERS and one DATA frame."""
    block = h2_request_block("/pkg.Svc/Echo")
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    return (
        frame_header(len(block), HEADERS, END_HEADERS, stream)
        + block
        + frame_header(len(framed), DATA, END_STREAM, stream)
        + framed
    )


class _FrameStream:
    """Reads a raw connection's frames one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""
        sock.settimeout(5)

    def until(self, want) -> list[tuple[int, int, int, bytes]]:
        """Frames (type, flags, stream, payload) up to and including the first one ``want`` accepts."""
        frames = []
        while True:
            while len(self.data) < 9 or len(self.data) < 9 + int.from_bytes(self.data[:3], "big"):
                got = self.sock.recv(65536)
                assert got, f"the connection closed; frames so far: {frames}"
                self.data += got
            length = int.from_bytes(self.data[:3], "big")
            head, payload, self.data = self.data[:9], self.data[9 : 9 + length], self.data[9 + length :]
            frame = (head[3], head[4], int.from_bytes(head[5:9], "big"), payload)
            frames.append(frame)
            if want(frame):
                return frames


def test_drain_serves_streams_sent_before_the_client_read_goaway_and_refuses_later_ones(
    server, grpc_engine
) -> None:
    listener = server()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        frames = _FrameStream(sock)
        sock.sendall(PREFACE + frame_header(0, SETTINGS, 0, 0) + _call_frames(1, b"abc"))
        frames.until(lambda f: f[0] == HEADERS and f[2] == 1 and f[1] & END_STREAM)
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(listener.drain(5.0, quiet_s=3.0)))
        drainer.start()
        # First GOAWAY: every stream is still taken, and a PING marks when the client has read it.
        seen = frames.until(lambda f: f[0] == PING and not f[1] & 1)
        goaway = next(payload for kind, _, _, payload in seen if kind == GOAWAY)
        assert struct.unpack(">II", goaway[:8]) == (0x7FFFFFFF, NO_ERROR)
        ping = seen[-1][3]
        # A call the client sent before it read the GOAWAY is served.
        sock.sendall(_call_frames(3, b"xyz"))
        answer = frames.until(lambda f: f[0] == HEADERS and f[2] == 3 and f[1] & END_STREAM)
        assert next(payload for kind, _, sid, payload in answer if kind == DATA and sid == 3)[5:] == b"zyx"
        # The PING acknowledged: the second GOAWAY names the last stream; a stream after it is refused.
        sock.sendall(frame_header(8, PING, 1, 0) + ping)
        final = frames.until(lambda f: f[0] == GOAWAY)[-1][3]
        assert struct.unpack(">II", final[:8]) == (3, NO_ERROR)
        sock.sendall(_call_frames(5, b"late"))
        if grpc_engine == "python":
            reset = frames.until(lambda f: f[0] == RST_STREAM)[-1]
            assert reset[2] == 5 and int.from_bytes(reset[3], "big") == REFUSED_STREAM
        else:  # nghttp2 ignores it and ends the connection: never taken, as the GOAWAY said
            with pytest.raises((AssertionError, ConnectionResetError), match=r"(?i)connection"):
                frames.until(lambda f: f[2] == 5)  # no frame of stream 5 before the end
    drainer.join(10)
    assert drained == [True]


def test_frames_keep_to_the_clients_settings_as_acknowledged(server) -> None:
    # A client holds the server to new settings only once it has the server's ACK (gRPC
    # checks frame sizes against acknowledged settings): a frame written before the ACK
    # must keep to the old maximum frame size, even by an answer already waiting to write.
    listener = server(threads=4)
    message = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than both sockets' buffers hold
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(("127.0.0.1", listener.port))
    with sock:
        window = (0x7FFFFFFF - 65535).to_bytes(4, "big")
        # Both calls at once: each runs on a worker, the first answer blocks the socket (the
        # client reads nothing yet) and the second waits for the write lock meanwhile.
        sock.sendall(
            PREFACE
            + frame_header(6, SETTINGS, 0, 0)
            + SETTING.pack(INITIAL_WINDOW_SIZE, 0x7FFFFFFF)
            + frame_header(0, SETTINGS, ACK, 0)  # the server's settings (its frame size) taken
            + frame_header(4, WINDOW_UPDATE, 0, 0)
            + window
            + _call_frames(1, message)
            + _call_frames(3, message)
        )
        time.sleep(0.5)
        sock.sendall(frame_header(6, SETTINGS, 0, 0) + SETTING.pack(MAX_FRAME_SIZE, 1 << 20))
        time.sleep(0.5)
        frames = _FrameStream(sock)
        ended: set[int] = set()
        acks: list[int] = []

        def both_answered(frame) -> bool:
            if frame[0] == HEADERS and frame[1] & END_STREAM:
                ended.add(frame[2])
            if frame[0] == SETTINGS and frame[1] & 1:
                acks.append(1)
            return ended == {1, 3} and len(acks) == 2

        seen = frames.until(both_answered)
    acks = [i for i, (kind, flags, _, _) in enumerate(seen) if kind == SETTINGS and flags & 1]
    assert len(acks) == 2  # of the client's first SETTINGS, and of its second
    sizes_before = [len(payload) for kind, _, _, payload in seen[: acks[1]] if kind == DATA]
    assert sizes_before and max(sizes_before) <= 16384, sorted(set(sizes_before))
    assert b"".join(p for kind, _, sid, p in seen if kind == DATA and sid == 3)[5:] == message[::-1]
