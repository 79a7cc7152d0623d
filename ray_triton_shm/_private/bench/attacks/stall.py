"""Slow or stalled clients: each holds what a call needs (a slot, a thread) at its own pace.

More of them than the model has slots (8 in the shipped config), each with a
1 MB ``identity`` tensor (16 MiB for answers never read, more than the sockets'
buffers hold).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import numpy as np

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.bench.attacks.catalog import Attack, count, hold
from ray_triton_shm._private.bench.attacks.wire import Target

CLIENTS = 16
CROWD = 80
"""Slow clients past the call bound: more than two replicas' ``max_ongoing_requests`` (32 each)."""


def _x() -> np.ndarray:
    return np.arange(wire.IDENTITY_N, dtype=np.float32).reshape(1, wire.IDENTITY_N)


def _trickle(sockets: list[socket.socket], until: float, every_s: float = 1.0) -> int:
    """One byte a second on each socket (``b"\\x00"`` as the next byte of its message) until ``until``;
    returns how many the server closed meanwhile."""
    closed: set[int] = set()
    while time.monotonic() < until:
        for i, s in enumerate(sockets):
            if i not in closed and not wire.send_quietly(s, b"\x00"):
                closed.add(i)
        hold(min(until, time.monotonic() + every_s))
    return len(closed)


def grpc_no_answer_window(target: Target, until: float, scale: float) -> dict[str, Any]:
    """Whole ``identity`` calls from clients that open no flow-control window for the answer
    (``SETTINGS_INITIAL_WINDOW_SIZE = 0``, a 4 KB receive buffer, nothing read)."""
    return _no_answer_window(target, until, count(CLIENTS, scale))


def grpc_unread_answers_past_the_bound(target: Target, until: float, scale: float) -> dict[str, Any]:
    """As :func:`grpc_no_answer_window`, more clients than the replicas' call bound, each asking for
    ``identity``'s version 1 (Triton's own path: no slot is held while the answer waits)."""
    return _no_answer_window(target, until, count(CROWD, scale), version="1")


def _no_answer_window(target: Target, until: float, clients: int, version: str = "") -> dict[str, Any]:
    framed = wire.grpc_framed(wire.identity_message(_x(), version=version))
    block = wire.request_block(wire.INFER_PATH)
    sockets: list[socket.socket] = []
    try:
        for _ in range(clients):
            s = wire.connect(target.host, target.grpc_port, rcvbuf=4096)
            sockets.append(s)
            opening = wire.H2_PREFACE + wire.settings(initial_window_size=0)
            opening += wire.frame(wire.HEADERS, wire.END_HEADERS, 1, block)
            wire.send_quietly(s, opening)
            wire.send_data(s, 1, framed, min(until, time.monotonic() + 5))
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"clients": len(sockets), "closed by server": closed}
    finally:
        wire.close_all(sockets)


STREAMS_PER_CONNECTION = 8


def grpc_streams_unread(target: Target, until: float, scale: float) -> dict[str, Any]:
    """Connections of several ``identity`` calls each (256 KB, through a slot), none opening a window
    for its answers: each answer waits on its client, and the calls of a connection of many streams
    run on the server's shared workers, not in the connection's own thread."""
    x = np.arange(1 << 16, dtype=np.float32).reshape(1, 1 << 16)
    framed = wire.grpc_framed(wire.identity_message(x))
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(CLIENTS, scale)):
            s = wire.connect(target.host, target.grpc_port, rcvbuf=4096)
            sockets.append(s)
            wire.send_quietly(s, wire.H2_PREFACE + wire.settings(initial_window_size=0))
            wire.server_settings(s)  # its windows: the messages need more than the first 65,535 bytes
        # A call on each connection at a time, a round every 0.2 s: each message finds a slot free
        # (the ones before gave theirs back when their answers stalled), so each runs as a placed call.
        for stream in range(1, 2 * STREAMS_PER_CONNECTION, 2):
            call = wire.frame(wire.HEADERS, wire.END_HEADERS, stream, wire.request_block(wire.INFER_PATH))
            call += wire.frame(wire.DATA, wire.END_STREAM, stream, framed)
            for s in sockets:
                wire.send_quietly(s, call)
            hold(min(until, time.monotonic() + 0.2))
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        calls_sent = len(sockets) * STREAMS_PER_CONNECTION
        return {"connections": len(sockets), "calls": calls_sent, "closed by server": closed}
    finally:
        wire.close_all(sockets)


def grpc_trickled_message(target: Target, until: float, scale: float) -> dict[str, Any]:
    """``identity`` calls whose message stops half-way, then goes on at a byte a second."""
    framed = wire.grpc_framed(wire.identity_message(_x()))
    block = wire.request_block(wire.INFER_PATH)
    half = framed[: min(len(framed) // 2, 60000)]  # within the default window
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(CLIENTS, scale)):
            s = wire.connect(target.host, target.grpc_port)
            sockets.append(s)
            opening = wire.H2_PREFACE + wire.settings() + wire.frame(wire.HEADERS, wire.END_HEADERS, 1, block)
            wire.send_quietly(s, opening)
            wire.send_data(s, 1, half, min(until, time.monotonic() + 5), end_stream=False)
        # Each further byte in a DATA frame of its own (a frame head, then one byte).
        closed: set[int] = set()
        while time.monotonic() < until:
            for i, s in enumerate(sockets):
                if i not in closed and not wire.send_quietly(s, wire.frame(wire.DATA, 0, 1, b"\x00")):
                    closed.add(i)
            hold(min(until, time.monotonic() + 1.0))
        return {"clients": len(sockets), "closed by server": len(closed)}
    finally:
        wire.close_all(sockets)


def http_trickled_body(target: Target, until: float, scale: float) -> dict[str, Any]:
    """``identity`` requests whose body stops half-way, then goes on at a byte a second."""
    return _trickled_bodies(target, until, count(CLIENTS, scale))


def http_slow_bodies_past_the_bound(target: Target, until: float, scale: float) -> dict[str, Any]:
    """As :func:`http_trickled_body`, more clients than the replicas' call bound, each asking for
    ``identity``'s version 1 (Triton's own path: the body is read into memory, no slot)."""
    return _trickled_bodies(target, until, count(CROWD, scale), version="1")


def _trickled_bodies(target: Target, until: float, clients: int, version: str = "") -> dict[str, Any]:
    head, body = wire.http_identity_request(_x(), version=version)
    sockets: list[socket.socket] = []
    try:
        for _ in range(clients):
            s = wire.connect(target.host, target.http_port)
            sockets.append(s)
            wire.send_quietly(s, head + body[: len(body) // 2])
        closed = _trickle(sockets, until)
        return {"clients": len(sockets), "closed by server": closed}
    finally:
        wire.close_all(sockets)


def _read_nothing(target: Target, until: float, scale: float, request: bytes) -> dict[str, Any]:
    """``request`` from each of 16 clients that read nothing of the answer (4 KB receive buffer)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(CLIENTS, scale)):
            s = wire.connect(target.host, target.http_port, rcvbuf=4096)
            sockets.append(s)
            wire.send_quietly(s, request)
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"clients": len(sockets), "closed by server": closed}
    finally:
        wire.close_all(sockets)


def http_answer_unread(target: Target, until: float, scale: float) -> dict[str, Any]:
    """Whole ``identity`` requests (16 MiB answers: more than the sockets' buffers hold) from clients
    that read nothing (4 KB receive buffer)."""
    n = 4 << 20  # FP32 elements: 16 MiB, the largest tensor of the shipped identity pool
    head, body = wire.http_identity_request(np.zeros((1, n), np.float32))
    return _read_nothing(target, until, scale, head + body)


def http_json_answers_unread(target: Target, until: float, scale: float) -> dict[str, Any]:
    """Whole ``identity`` requests of a 1 MB tensor as JSON (about 5 MB of text), each asking for its
    answer as JSON, from clients that read nothing: the server decodes and encodes JSON for each."""
    x = np.random.default_rng(0).random(wire.IDENTITY_N, dtype=np.float32)
    body = json.dumps(
        {
            "inputs": [{"name": "INPUT0", "shape": [1, x.size], "datatype": "FP32", "data": x.tolist()}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
        }
    ).encode()
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return _read_nothing(target, until, scale, head + body)


ATTACKS = (
    Attack(
        name="grpc-no-answer-window",
        kind="stalled",
        protocol="grpc",
        run=grpc_no_answer_window,
        summary="16 gRPC calls (1 MB) that open no window for their answer",
    ),
    Attack(
        name="grpc-trickled-message",
        kind="stalled",
        protocol="grpc",
        run=grpc_trickled_message,
        summary="16 gRPC calls stopping half-way, then 1 byte/s",
    ),
    Attack(
        name="grpc-streams-unread",
        kind="stalled",
        protocol="grpc",
        run=grpc_streams_unread,
        summary="16 gRPC connections of 8 calls each (256 KB) that open no window for their answers",
    ),
    Attack(
        name="http-trickled-body",
        kind="stalled",
        protocol="http",
        run=http_trickled_body,
        summary="16 HTTP bodies (1 MB) stopping half-way, then 1 byte/s",
    ),
    Attack(
        name="http-answer-unread",
        kind="stalled",
        protocol="http",
        run=http_answer_unread,
        summary="16 HTTP calls whose 16 MiB answer is never read",
    ),
    Attack(
        name="http-json-answers-unread",
        kind="stalled",
        protocol="http",
        run=http_json_answers_unread,
        summary="16 HTTP calls of a 1 MB tensor as JSON, answered as JSON (5 MB) never read",
    ),
    Attack(
        name="http-slow-bodies-past-the-bound",
        kind="stalled",
        protocol="http",
        run=http_slow_bodies_past_the_bound,
        summary="80 HTTP bodies (1 MB, version 1) stopping half-way, then 1 byte/s: past the call bound",
    ),
    Attack(
        name="grpc-unread-answers-past-the-bound",
        kind="stalled",
        protocol="grpc",
        run=grpc_unread_answers_past_the_bound,
        summary="80 gRPC calls (1 MB, version 1) that open no window for their answer: past the call bound",
    ),
)
