"""The front door's HTTP/2 gRPC server, spoken to by grpcio's own client (and by hand, for bad input)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import hpack
import pytest

from ray_triton_shm._private.serve.door.frontdoor_grpc import H2Listener
from ray_triton_shm._private.serve.http2.h2_wire import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    PREFACE,
    PROTOCOL_ERROR,
    SETTING,
    SETTINGS,
    Call,
    CallError,
    H2Limits,
    frame_header,
    percent_encode,
)
from tests.helpers import h2_frames_until_closed


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


def test_protocol_errors_end_the_connection_with_goaway(server) -> None:
    listener = server()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.sendall(PREFACE + frame_header(0, SETTINGS, 0, 0) + frame_header(4, 0, 0, 0) + b"data")
        frames = h2_frames_until_closed(sock)
    assert frames[0][0] == SETTINGS
    goaway = [payload for kind, _, payload in frames if kind == GOAWAY]
    assert goaway and struct.unpack(">II", goaway[0][:8])[1] == PROTOCOL_ERROR
    assert b"DATA on stream 0" in goaway[0][8:]
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
