"""Our hand-written HTTP/1.1 client against the standard library's and urllib3, on the native server.

Shm requests go to Triton as a few hundred bytes of JSON over kept-alive
connections (:mod:`ray_triton_shm._private.triton.http_infer`). This measures the same
requests (identity on the native backend, its input filled in place once, so a
request is only the HTTP exchange and the server's memcpy) sent through each
connection kind: ours (raw socket), ``http.client.HTTPConnection``, and
``urllib3.HTTPConnectionPool`` when installed. Rounds alternate the kinds, so
a slow spell of a shared machine falls on all of them.

Run: ``python -m ray_triton_shm._private.bench.http_clients [--rounds N] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ray_triton_shm._private.triton.http_infer import Connection, HttpShmSender, ShmInput, ShmOutput
from ray_triton_shm._private.triton.native import require_native_models
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.server import TritonServer

KB = 1024
MB = 1024 * KB
MODEL = "identity"


class StdlibConnection:
    """``http.client`` on one kept-alive connection, with the same ``post`` as ours."""

    def __init__(self, host: str, port: int, timeout_s: float | None) -> None:
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self._conn.connect()
        self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        self._conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = self._conn.getresponse()
        return response.status, response.read(), not response.will_close

    def close(self) -> None:
        self._conn.close()


class Urllib3Connection:
    """``urllib3.HTTPConnectionPool`` of one kept-alive connection, with the same ``post`` as ours."""

    def __init__(self, host: str, port: int, timeout_s: float | None) -> None:
        import urllib3  # lazy: urllib3 is optional here (its row is left out without it)

        self._pool = urllib3.HTTPConnectionPool(host, port, maxsize=1, timeout=timeout_s, retries=False)

    def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        response = self._pool.urlopen(
            "POST", path, body=body, headers={"Content-Type": "application/json"}, preload_content=True
        )
        return response.status, response.data, True

    def close(self) -> None:
        self._pool.close()


def _sender_class(connection: Callable[..., Any]) -> type[HttpShmSender]:
    class Sender(HttpShmSender):
        def _connect(self) -> Any:
            return connection(self._host, self._port, self._timeout_s)

    return Sender


def connection_kinds() -> dict[str, Callable[..., Any]]:
    """Connection classes by name: ours, http.client, and urllib3 when it is installed."""
    kinds: dict[str, Callable[..., Any]] = {"ours": Connection, "http.client": StdlibConnection}
    try:
        import urllib3  # noqa: F401  # lazy: probes for the optional urllib3
    except ImportError:
        pass
    else:
        kinds["urllib3"] = Urllib3Connection
    return kinds


def compare(sizes: tuple[int, ...] = (4 * KB, 16 * MB), rounds: int = 5) -> list[dict[str, Any]]:
    """Per size and kind: median wall ms and mean client CPU ms per request, over ``rounds`` rounds."""
    kinds = connection_kinds()
    rows: list[dict[str, Any]] = []
    with TritonServer(ServerConfig(model_repository=require_native_models())) as server:
        for size in sizes:
            n = size // 4
            pool = PoolConfig(slots=1, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
            with (
                TritonShmClient(url=server.grpc_url, pools={MODEL: pool}) as client,
                client.lease(MODEL) as lease,
            ):
                x = np.random.default_rng(0).random((1, n), dtype=np.float32)
                lease.input("INPUT0", x.shape)[...] = x
                layout = lease.layout
                region, base = lease.region_name, lease.offset
                inputs = [
                    ShmInput("INPUT0", x.shape, "FP32", region, x.nbytes, base + layout.inputs[0].offset)
                ]
                outputs = [
                    ShmOutput("OUTPUT0", region, layout.outputs[0].capacity, base + layout.outputs[0].offset)
                ]
                senders = {name: _sender_class(kind)(server.http_url, 60.0) for name, kind in kinds.items()}
                calls = 300 if size < MB else 20
                wall: dict[str, list[float]] = {name: [] for name in senders}
                cpu: dict[str, float] = dict.fromkeys(senders, 0.0)
                try:
                    for sender in senders.values():  # connect, and the server's first touch of the pages
                        for _ in range(3):
                            sender.infer(MODEL, inputs, outputs)
                    for index in range(rounds):
                        order = list(senders) if index % 2 == 0 else list(reversed(senders))
                        for name in order:
                            sender = senders[name]
                            cpu_began = time.process_time()
                            for _ in range(calls):
                                began = time.perf_counter()
                                shapes = sender.infer(MODEL, inputs, outputs)
                                wall[name].append(time.perf_counter() - began)
                            cpu[name] += time.process_time() - cpu_began
                            if shapes != {"OUTPUT0": x.shape}:
                                raise AssertionError(f"{name}: wrong answer {shapes}")
                    if not np.array_equal(lease.output("OUTPUT0", x.shape), x):
                        raise AssertionError("the identity's output differs from its input")
                finally:
                    for sender in senders.values():
                        sender.close()
                for name in senders:
                    rows.append(
                        {
                            "payload_bytes": size,
                            "client": name,
                            "p50_ms": statistics.median(wall[name]) * 1e3,
                            "mean_ms": statistics.fmean(wall[name]) * 1e3,
                            "cpu_ms": cpu[name] / (rounds * calls) * 1e3,
                            "requests": len(wall[name]),
                        }
                    )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """A text table with each client's p50 and CPU relative to ours."""
    ours = {r["payload_bytes"]: r for r in rows if r["client"] == "ours"}
    lines = [f"{'payload':>8}  {'client':<12} {'p50 ms':>8} {'mean ms':>8} {'CPU ms':>8} {'p50 / ours':>10}"]
    for r in rows:
        mine = ours.get(r["payload_bytes"])
        ratio = r["p50_ms"] / mine["p50_ms"] if mine else math.nan
        size = r["payload_bytes"]
        label = f"{size // MB} MB" if size >= MB else f"{size // KB} KB"
        lines.append(
            f"{label:>8}  {r['client']:<12} {r['p50_ms']:8.3f} {r['mean_ms']:8.3f} "
            f"{r['cpu_ms']:8.3f} {ratio:10.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = compare(rounds=args.rounds)
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
