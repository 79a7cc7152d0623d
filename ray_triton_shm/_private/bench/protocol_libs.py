"""The front door's protocol code against well-kept libraries' in one run: MB/s and CPU per call.

Each variant is the front door's transport serving an echo of a 1 MB payload
through a slot: the request's payload is read into one of 8 preallocated
1 MB slots and the answer is sent from the slot. Only the protocol state
machine differs:

* ``http1-ours``: the HTTP/1.1 listener, heads read by the hand-written reader
  (:func:`~ray_triton_shm._private.serve.http1.head.parse_head_by_hand`);
* ``http1-httptools``: the same listener, heads read by llhttp (``httptools``)
  with the checks on top (:func:`~ray_triton_shm._private.serve.http1.head.parse_head`);
* ``http1-h11``: the same listener, heads read by ``h11``
  (:func:`~ray_triton_shm._private.bench.protocol_variants.parse_head_h11`);
* ``grpc-ours``: the front door's gRPC listener (hand-written HTTP/2 framing,
  HPACK by ``hpack``), the message placed straight into the slot from the socket;
* ``grpc-h2``: a gRPC server on ``h2`` (hyper-h2) and its ``hpack``
  (:class:`~ray_triton_shm._private.bench.protocol_variants.LibH2Server`);
* ``grpc-ngh2``: the same server on nghttp2 (the ``ngh2`` binding).

Callers are processes of their own (``--callers``, each with one connection,
one call at a time): raw HTTP/1.1 requests shaped as ``tritonclient.http``
sends them, and ``grpcio`` unary calls. Each round runs every
variant for ``--duration-s``, the order reversed every other round (ABBA),
so load from elsewhere falls on each alike. ``MB/s`` counts request payload
bytes of all callers together; ``CPU ms/call`` is the server process's CPU
time (user and system, all threads) over the calls answered. The table gives
each variant's median over the rounds, and as the ratios the median of the
rounds' own ratios (library over ours, measured back to back). Without
Triton in the loop, a transport's cost is a larger share of each call than in
the whole front door: the ratio here is the upper bound of what the library
would cost there.

Run::

    python -m ray_triton_shm._private.bench.protocol_libs --size 1M --callers 8 --rounds 4 --duration-s 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import resource
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.bench.protocol_variants import LibH2Server, parse_head_h11
from ray_triton_shm._private.serve.http1.body import Body
from ray_triton_shm._private.serve.http1.head import RequestHead, parse_head, parse_head_by_hand
from ray_triton_shm._private.serve.http1.server import Connection, HeadParser, HttpListener
from ray_triton_shm._private.serve.http2.grpc_message import Placement
from ray_triton_shm._private.serve.http2.h2_listener import H2Listener
from ray_triton_shm._private.serve.http2.h2_stream import Call

METHOD = "/inference.GRPCInferenceService/ModelInfer"
HTTP_PATH = "/v2/models/identity/infer"
LIMIT = 0.10
"""A library is adopted where it costs no more than this (MB/s and CPU per call) over ours."""


class Slot:
    """One preallocated buffer, leased to one call at a time."""

    def __init__(self, size: int, free: queue.Queue[Slot]) -> None:
        self.view = memoryview(bytearray(size))
        self._free = free
        self._held = False

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if self._held:
            self._held = False
            self._free.put(self)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SlotPool:
    """``count`` slots of ``size`` bytes; :meth:`lease` waits for a free one."""

    def __init__(self, count: int, size: int) -> None:
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(count):
            self._free.put(Slot(size, self._free))

    def lease(self) -> Slot:
        slot = self._free.get(timeout=30)
        slot._held = True
        return slot


# -- the servers -------------------------------------------------------------------------------


def http_server(pool: SlotPool, parse: HeadParser) -> HttpListener:
    """The front door's HTTP/1.1 listener, echoing each body through a slot."""

    def handle(conn: Connection, head: RequestHead, body: Body) -> None:
        n = body.remaining
        with pool.lease() as slot:
            view = slot.view[:n]
            body.readinto(view)
            conn.respond(200, [("content-type", "application/octet-stream")], [view])

    return HttpListener("127.0.0.1", 0, handle, parse=parse)


def grpc_server(pool: SlotPool) -> H2Listener:
    """The front door's gRPC listener, its messages placed into a slot and echoed from it."""

    def place(head: bytes, length: int) -> Placement | None:
        slot = pool.lease()
        return Placement(slot, b"", [slot.view[:length]], None)

    def handle(call: Call) -> None:
        placement = call.placement()
        if placement is None:
            call.respond([bytes(call.request())])
            return
        slot, view = placement.lease, placement.parts[0]
        placement.parts.clear()
        try:
            call.respond([view], slot.release)
        finally:
            slot.release()

    return H2Listener("127.0.0.1", 0, handle, place=lambda method: place)


@dataclass
class Variant:
    name: str
    protocol: str  # "http" or "grpc"
    port: int
    close: Callable[[], None]
    rounds: list[dict[str, float]] = field(default_factory=list)


# -- the callers -------------------------------------------------------------------------------


def _http_head(port: int, length: int) -> bytes:
    """A request head as ``tritonclient.http`` sends one with a binary body of ``length`` bytes."""
    return (
        f"POST {HTTP_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"User-Agent: python/gevent-http-client-1.5\r\n"
        f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: 0\r\n"
        f"Accept-Encoding: identity\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _http_caller(port: int, payload: bytes, until: float) -> int:
    head = _http_head(port, len(payload))
    answer = memoryview(bytearray(len(payload)))
    calls = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = b""
        while time.monotonic() < until:
            s.sendall(head)
            s.sendall(payload)
            while b"\r\n\r\n" not in pending:
                got = s.recv(65536)
                if not got:
                    raise ConnectionError("the server closed the connection")
                pending += got
            top, _, rest = pending.partition(b"\r\n\r\n")
            if not top.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(top[:200].decode("latin-1"))
            length = int(top.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            have = min(len(rest), length)
            answer[:have] = rest[:have]
            pending = rest[have:]
            while have < length:
                got = s.recv_into(answer[have:length])
                if not got:
                    raise ConnectionError("the server closed the connection")
                have += got
            if answer[:length] != payload:
                raise RuntimeError("the answer differs from the request")
            calls += 1
    return calls


def _grpc_caller(port: int, payload: bytes, until: float) -> int:
    import grpc  # lazy: only grpc callers load it

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    calls = 0
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = channel.unary_unary(METHOD)
        while time.monotonic() < until:
            if stub(payload, timeout=30) != payload:
                raise RuntimeError("the answer differs from the request")
            calls += 1
    return calls


def _caller(commands: Any, results: Any, size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    while True:
        command = commands.get()
        if command is None:
            return
        protocol, port, start, until = command
        time.sleep(max(0.0, start - time.time()))
        mono_until = time.monotonic() + (until - time.time())
        try:
            run = _http_caller if protocol == "http" else _grpc_caller
            results.put(run(port, payload, mono_until))
        except Exception as e:
            results.put(f"{type(e).__name__}: {e}")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    variant: Variant, callers: list[tuple[Any, Any]], size: int, duration_s: float
) -> dict[str, float]:
    """One round of one variant: every caller for ``duration_s``; MB/s and server CPU ms per call."""
    start = time.time() + 0.5
    for commands, _ in callers:
        commands.put((variant.protocol, variant.port, start, start + duration_s))
    time.sleep(max(0.0, start - time.time()))
    cpu0, t0 = _cpu_s(), time.monotonic()
    got = [results.get(timeout=duration_s + 120) for _, results in callers]
    cpu1, t1 = _cpu_s(), time.monotonic()
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        raise RuntimeError(f"{variant.name}: {errors[0]}")
    calls = sum(got)
    return {
        "calls": calls,
        "mb_s": calls * size / 1e6 / (t1 - t0),
        "cpu_ms_per_call": (cpu1 - cpu0) * 1e3 / max(calls, 1),
    }


# -- the run -----------------------------------------------------------------------------------

PAIRS = (
    ("http1-ours", "http1-httptools"),
    ("http1-ours", "http1-h11"),
    ("grpc-ours", "grpc-h2"),
    ("grpc-ours", "grpc-ngh2"),
)


PARSERS: dict[str, Callable[[Any], RequestHead]] = {
    "http1-ours": parse_head_by_hand,
    "http1-httptools": parse_head,
    "http1-h11": parse_head_h11,
}
VARIANTS = (*PARSERS, "grpc-ours", "grpc-h2", "grpc-ngh2")


def head_cost_us(parse: Callable[[Any], RequestHead], size: int, repeat: int = 20000) -> float:
    """Microseconds one request head (as the callers send it) takes ``parse``."""
    head = _http_head(8100, size)
    began = time.perf_counter()
    for _ in range(repeat):
        parse(head)
    return (time.perf_counter() - began) / repeat * 1e6


def _start(name: str, pool: SlotPool) -> Variant:
    if name in PARSERS:
        listener = http_server(pool, PARSERS[name])
        return Variant(name, "http", listener.port, listener.close)
    if name == "grpc-ours":
        ours = grpc_server(pool)
        return Variant(name, "grpc", ours.port, ours.close)
    lib = LibH2Server(pool.lease, name.removeprefix("grpc-"))
    return Variant(name, "grpc", lib.port, lib.close)


def run(
    size: int, n_callers: int, rounds: int, duration_s: float, names: tuple[str, ...] = VARIANTS
) -> dict[str, Any]:
    """Start the variants, measure them round by round, and compare each library with ours."""
    pool = SlotPool(n_callers, size)
    servers = [_start(name, pool) for name in names]
    ctx = multiprocessing.get_context("spawn")
    callers = []
    procs = []
    for _ in range(n_callers):
        commands, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_caller, args=(commands, results, size), daemon=True)
        proc.start()
        procs.append(proc)
        callers.append((commands, results))
    try:
        for variant in servers:  # warm-up: connections, imports, first allocations
            measure(variant, callers, size, 0.5)
        for r in range(rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for variant in order:
                variant.rounds.append(measure(variant, callers, size, duration_s))
                print(f"round {r + 1} {variant.name}: {variant.rounds[-1]}", flush=True)
    finally:
        for commands, _ in callers:
            commands.put(None)
        for proc in procs:
            proc.join(timeout=10)
        for variant in servers:
            variant.close()
    by_name = {v.name: v for v in servers}
    medians = {
        v.name: {
            "mb_s": statistics.median(r["mb_s"] for r in v.rounds),
            "cpu_ms_per_call": statistics.median(r["cpu_ms_per_call"] for r in v.rounds),
        }
        for v in servers
    }
    comparisons = []
    for base, other in PAIRS:
        if base not in medians or other not in medians:
            continue
        a, b = by_name[base].rounds, by_name[other].rounds
        # Each round measures both back to back: the median of the rounds' ratios.
        mb_ratio = statistics.median(y["mb_s"] / x["mb_s"] for x, y in zip(a, b, strict=True))
        cpu_ratio = statistics.median(
            y["cpu_ms_per_call"] / x["cpu_ms_per_call"] for x, y in zip(a, b, strict=True)
        )
        within = mb_ratio >= 1 - LIMIT and cpu_ratio <= 1 + LIMIT
        comparisons.append(
            {
                "ours": base,
                "library": other,
                "ours_mb_s": medians[base]["mb_s"],
                "library_mb_s": medians[other]["mb_s"],
                "mb_s_ratio": mb_ratio,
                "ours_cpu_ms": medians[base]["cpu_ms_per_call"],
                "library_cpu_ms": medians[other]["cpu_ms_per_call"],
                "cpu_ratio": cpu_ratio,
                "within_limit": within,
            }
        )
    return {
        "size": size,
        "callers": n_callers,
        "rounds": rounds,
        "duration_s": duration_s,
        "variants": {name: {"rounds": v.rounds, **medians[name]} for name, v in by_name.items()},
        "comparisons": comparisons,
        "head_us": {name: head_cost_us(PARSERS[name], size) for name in names if name in PARSERS},
    }


def table(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| variant (library) | ours MB/s | library MB/s | MB/s ratio | ours CPU ms/call "
        "| library CPU ms/call | CPU ratio | within 10% |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in result["comparisons"]:
        lines.append(
            f"| {c['library']} vs {c['ours']} | {c['ours_mb_s']:.0f} | {c['library_mb_s']:.0f} "
            f"| {c['mb_s_ratio']:.2f} | {c['ours_cpu_ms']:.3f} | {c['library_cpu_ms']:.3f} "
            f"| {c['cpu_ratio']:.2f} | {'yes' if c['within_limit'] else 'no'} |"
        )
    heads = ", ".join(f"{name} {us:.1f} us" for name, us in result["head_us"].items())
    if heads:
        lines.append(f"\nOne request head parsed: {heads}.")
    return "\n".join(lines)


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1M", help="payload per call (1M: 1 MiB)")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=3.0)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    names = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    result = run(_size(args.size), args.callers, args.rounds, args.duration_s, names)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
