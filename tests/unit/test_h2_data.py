"""Runs of DATA frames read in C (``_h2_data``): what a run takes, where it stops, and the server with it.

A run reads the plain DATA frames of one stream straight into a slot's view and leaves
every other frame, unread, to the Python reader; the server answers the same with and
without it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ray_triton_shm._private.serve.http2 import h2_reader
from ray_triton_shm._private.serve.http2.h2_control import set_kernel_timeout
from ray_triton_shm._private.serve.http2.h2_reader import FrameReader
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PADDED,
    PREFACE,
    SETTING,
    SETTINGS,
    WINDOW_UPDATE,
    frame_header,
)
from tests.helpers import assert_built_from_current_source, h2_request_block, h2_whole_frames

pytestmark = pytest.mark.usefixtures("grpc_engine")  # each test on each engine

needs_runs = pytest.mark.skipif(not FrameReader.reads_runs(), reason="the C extension _h2_data is not built")

FRAME = 16384  # what nghttp2, Go and Java send
# The client's settings: windows of 1 GiB for the server's answers.
_WINDOWS = (  # wide windows the server's way, and its settings taken (as every real client does)
    frame_header(6, SETTINGS, 0, 0)
    + SETTING.pack(INITIAL_WINDOW_SIZE, 1 << 30)
    + frame_header(0, SETTINGS, ACK, 0)
    + frame_header(4, WINDOW_UPDATE, 0, 0)
    + (1 << 30).to_bytes(4, "big")
)


def test_the_c_run_reader_is_built() -> None:
    assert FrameReader.reads_runs(), (
        "the _h2_data extension was not built (pip install -e . with a C compiler)"
    )
    assert_built_from_current_source(h2_reader._h2_data)


@pytest.fixture
def pair():
    server, client = socket.socketpair()
    set_kernel_timeout(server, socket.SO_RCVTIMEO, 0.3)  # as while a slot waits for a message's bytes
    yield server, client
    server.close()
    client.close()


def _data(stream: int, payload: bytes, flags: int = 0) -> bytes:
    return frame_header(len(payload), DATA, flags, stream) + payload


@needs_runs
def test_a_run_reads_plain_data_frames_into_place_and_leaves_the_next_frame(pair) -> None:
    server, client = pair
    payloads = [bytes([i]) * FRAME for i in range(4)]
    other = frame_header(3, HEADERS, END_HEADERS, 3) + b"abc"
    client.sendall(b"".join(_data(1, p) for p in payloads) + other)
    reader = FrameReader(server)
    target = bytearray(100_000)
    assert reader.data_run([(1, memoryview(target))], time.monotonic() + 5) == ([4 * FRAME], 4 * FRAME, 0, 0)
    assert target[: 4 * FRAME] == b"".join(payloads)
    assert not any(target[4 * FRAME :])
    assert reader.exactly(len(other)) == other


@needs_runs
@pytest.mark.parametrize(
    "stop",
    [
        _data(1, b"last", END_STREAM),
        _data(1, b"\x01abcdx", PADDED),
        _data(3, b"othr"),
        _data(1, b""),
        frame_header(200_000, DATA, 0, 1),  # more than the target has room for
        frame_header(4, HEADERS, END_HEADERS, 1) + b"trlr",
    ],
    ids=["end-stream", "padded", "other-stream", "empty", "too-long", "headers"],
)
def test_a_run_stops_before_any_frame_the_python_reader_must_judge(pair, stop: bytes) -> None:
    server, client = pair
    client.sendall(_data(1, b"0123456789") + stop)
    reader = FrameReader(server)
    target = bytearray(100_000)
    assert reader.data_run([(1, memoryview(target))], time.monotonic() + 5) == ([10], 10, 0, 0)
    assert target[:10] == b"0123456789"
    assert reader.exactly(9) == stop[:9]


@needs_runs
def test_interleaved_frames_of_several_streams_go_each_into_its_own_view(pair) -> None:
    server, client = pair
    frames = [_data(sid, bytes([sid]) * 1000 * k) for k in (1, 2, 3) for sid in (1, 3, 5)]
    client.sendall(b"".join(frames) + _data(7, b"not ours"))
    reader = FrameReader(server)
    views = {sid: bytearray(6000) for sid in (1, 3, 5)}
    targets = [(sid, memoryview(view)) for sid, view in views.items()]
    assert reader.data_run(targets, time.monotonic() + 5) == ([6000] * 3, 18000, 0, 2)
    assert all(view == bytes([sid]) * 6000 for sid, view in views.items())
    assert reader.exactly(9) == frame_header(8, DATA, 0, 7)


@needs_runs
def test_a_frame_cut_short_by_the_receive_timeout_leaves_its_rest_to_read(pair) -> None:
    server, client = pair
    client.sendall(frame_header(1000, DATA, 0, 1) + b"a" * 300)
    reader = FrameReader(server)
    target = bytearray(5000)
    assert reader.data_run([(1, memoryview(target))], time.monotonic() + 5) == ([300], 1000, 700, 0)
    client.sendall(b"b" * 700)
    reader.into(memoryview(target)[300:1000])
    assert target[:1000] == b"a" * 300 + b"b" * 700


@needs_runs
def test_a_connection_closed_within_a_frame_ends_the_run(pair) -> None:
    server, client = pair
    client.sendall(_data(1, b"x" * 50) + frame_header(1000, DATA, 0, 1) + b"y" * 20)
    client.close()
    reader = FrameReader(server)
    target = bytearray(5000)
    assert reader.data_run([(1, memoryview(target))], time.monotonic() + 5) == ([70], 1050, 980, 0)
    with pytest.raises(EOFError):
        reader.exactly(1)


@needs_runs
def test_a_run_waits_for_no_frame_once_its_target_is_full_nor_past_its_deadline(pair) -> None:
    server, client = pair
    set_kernel_timeout(server, socket.SO_RCVTIMEO, 5.0)
    client.sendall(_data(1, b"z" * 10))
    reader = FrameReader(server)
    started = time.monotonic()
    assert reader.data_run([(1, memoryview(bytearray(10)))], started + 5) == ([10], 10, 0, 0)
    client.sendall(_data(1, b"w" * 10))
    assert reader.data_run([(1, memoryview(bytearray(100)))], time.monotonic() - 1) == ([0], 0, 0, -1)
    assert time.monotonic() - started < 2  # neither run waited for bytes
    assert reader.exactly(9) == frame_header(10, DATA, 0, 1)


@needs_runs
def test_buffer_bounds_are_checked() -> None:
    from ray_triton_shm._private.serve.http2 import _h2_data

    deadline = time.monotonic() + 1
    with pytest.raises(ValueError):
        _h2_data.read_data_frames(0, bytearray(64), 10, 5, [(1, bytearray(8))], deadline)
    with pytest.raises(ValueError):
        _h2_data.read_data_frames(0, bytearray(64), 0, 65, [(1, bytearray(8))], deadline)
    with pytest.raises(TypeError):
        _h2_data.read_data_frames(0, bytearray(64), 0, 0, [(1, b"read-only")], deadline)


@pytest.mark.parametrize(
    "runs", [pytest.param(True, marks=needs_runs), False], ids=["c-runs", "python-frames"]
)
def test_messages_in_interleaved_16_kb_frames_are_placed_whole_with_or_without_runs(
    monkeypatch, runs: bool, grpc_engine: str
) -> None:
    """Three calls at once on one connection, their messages in 16 KB frames taking turns, as
    nghttp2 sends them: each is placed whole and answered, the same with the C runs or without."""
    from tests.unit.test_grpc_message import HEAD, KEY, _placed_listener

    if not runs:
        monkeypatch.setattr(h2_reader, "_h2_data", None)
    in_runs = []
    data_run = FrameReader.data_run

    def counted(self, targets: list, deadline: float) -> tuple[list[int], int, int, int]:
        taken = data_run(self, targets, deadline)
        in_runs.append(taken[1])
        return taken

    monkeypatch.setattr(FrameReader, "data_run", counted)
    listener, leases = _placed_listener()
    streams = (1, 3, 5)
    bodies = {sid: bytes([sid]) * 700_000 + bytes(range(256)) * 1000 for sid in streams}
    framed = {}
    for sid, body in bodies.items():
        message = HEAD + KEY + body
        framed[sid] = b"\x00" + len(message).to_bytes(4, "big") + message
    try:
        block = h2_request_block("/pkg.Svc/Put")
        wire = PREFACE + _WINDOWS
        for sid in streams:
            wire += frame_header(len(block), HEADERS, END_HEADERS, sid) + block
        for at in range(0, max(len(m) for m in framed.values()), FRAME):
            for sid in streams:
                chunk = framed[sid][at : at + FRAME]
                if chunk:
                    wire += _data(sid, chunk, END_STREAM if at + FRAME >= len(framed[sid]) else 0)
        answers = {sid: b"" for sid in streams}
        want = {sid: 5 + len(b"placed:") + len(body) for sid, body in bodies.items()}
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            sender = threading.Thread(target=sock.sendall, args=(wire,))
            sender.start()
            sock.settimeout(10)
            data = b""
            while any(len(answers[sid]) < want[sid] for sid in streams):
                got = sock.recv(1 << 20)
                assert got, "the server closed the connection"
                data += got
                frames = h2_whole_frames(data)
                answers = {sid: b"" for sid in streams}
                for kind, sid, payload in frames:
                    if kind == DATA and sid in answers:
                        answers[sid] += payload
            sender.join(10)
        for sid, body in bodies.items():
            assert answers[sid][5:] == b"placed:" + body
        assert leases.taken == len(streams)
        # With runs, most of the messages came through them; without, none of them (nghttp2's
        # connections read no frames in Python).
        total = sum(len(m) for m in framed.values())
        assert sum(in_runs) > total // 2 if runs and grpc_engine == "python" else not sum(in_runs)
    finally:
        listener.close()
    assert leases.out() == 0
