"""Profile of one KServe v2 binary request through the Serve HTTP ingress, and the three HTTP rows.

``profile``: a local Ray, the node's Triton (the native identity), the Serve app
behind Serve's HTTP proxy, and ``tritonclient.http`` sending a binary FP32
request of ``--size`` bytes that asks for a binary output. Inside the replica,
every request of the app is measured: wall time of the handler, the peak of the
memory Python allocated during it (``tracemalloc``; each copy of the payload
that our code makes is one payload size of it), the allocations of at least one
payload that are still alive when the handler returns (with the lines that made
them), and a ``cProfile`` of the handler.

``--compare``: the three rows of :mod:`ray_triton_shm._private.bench.http_ingress`
(ours, the same app with gRPC behind it, ``tritonclient.http`` straight to
Triton), in one run, rounds taking turns.

Run (a Ray cluster of its own; on a shared machine under the lock)::

    python -m ray_triton_shm._private.bench.ingress_profile --size 16M
    python -m ray_triton_shm._private.bench.ingress_profile --compare --sizes 1M,16M --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import logging
import pstats
import statistics
import sys
import time
import tracemalloc
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ray_triton_shm._private.bench.cells import run_group
from ray_triton_shm._private.bench.core_methods import make_inputs
from ray_triton_shm._private.bench.http_ingress import HTTP_METHODS, ROUTES, http_cell, start_grpc_behind
from ray_triton_shm._private.bench.options import BenchOptions
from ray_triton_shm._private.bench.tables import size_label
from ray_triton_shm._private.bench.timing import Progress
from ray_triton_shm._private.serve.protocol import kserve
from ray_triton_shm._private.triton.native import require_native_models
from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors
from ray_triton_shm.serve import TritonDeployment

KB = 1024
MB = 1024 * KB
MODEL = "identity"
_TRACE_DEPTH = 12


class _Profiled(TritonDeployment.func_or_class):  # type: ignore[name-defined,misc]
    """:class:`TritonDeployment` that measures each HTTP request it answers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reports: list[dict[str, Any]] = []
        self._stages: list[tuple[str, float, float]] = []

        # The stages, timed where they exist (not every version of the ingress has each of them).
        for name in ("decode_request", "plan_request", "encode_response"):
            if hasattr(kserve, name):
                setattr(kserve, name, self._timed(name, getattr(kserve, name)))
        for name in ("ainfer", "alease", "arun"):
            if hasattr(self._client, name):
                setattr(self._client, name, self._timed(name, getattr(self._client, name)))

    def _timed(self, stage: str, fn: Any) -> Any:
        if inspect.iscoroutinefunction(fn):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._stages.append((stage, began, time.perf_counter()))

            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._stages.append((stage, began, time.perf_counter()))

        return timed

    async def __call__(self, request: Request) -> Response:
        if not tracemalloc.is_tracing():
            tracemalloc.start(_TRACE_DEPTH)
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        profiler = cProfile.Profile()
        self._stages = []
        receive = request._receive
        chunks = [0]

        async def timed_receive() -> Any:  # when the last chunk of the body has come
            message = await receive()
            if message.get("type") == "http.request":
                chunks[0] += 1
                if not message.get("more_body", False):
                    self._stages.append(("body received", began, time.perf_counter()))
            return message

        request._receive = timed_receive
        began = time.perf_counter()
        profiler.enable()
        try:
            response = await super().__call__(request)
        finally:
            profiler.disable()
        wall_s = time.perf_counter() - began
        stages = [(name, (a - began) * 1e3, (b - began) * 1e3) for name, a, b in self._stages]
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot()
        length = int(request.headers.get("content-length") or 0)
        alive = [
            {"bytes": stat.size, "where": [f"{f.filename}:{f.lineno}" for f in stat.traceback]}
            for stat in snapshot.statistics("traceback")
            if stat.size >= max(length // 2, 1)
        ]
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        self._reports.append(
            {
                "request_bytes": length,
                "response_bytes": len(getattr(response, "body", b"")),
                "wall_ms": wall_s * 1e3,
                "stages_ms": stages,
                "body_chunks": chunks[0],
                "peak_extra_bytes": peak - base,
                "alive_extra_bytes": current - base,
                "alive_large": alive,
                "cprofile": text.getvalue(),
            }
        )
        return response

    async def reports(self) -> list[dict[str, Any]]:
        """The measurements of every request so far (and forget them)."""
        out, self._reports = self._reports, []
        return out


ProfiledDeployment = serve.deployment(
    _Profiled, name="ProfiledIngress", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32
)


def _node_config(repository: str | None, max_bytes: int) -> Any:
    n = max(1, max_bytes // 4)
    pool = PoolConfig(slots=4, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    server = ServerConfig(model_repository=require_native_models(repository))
    return NodeConfig(server=server, pools={MODEL: pool})


def profile(size: int, calls: int, port: int, node_config: Any) -> dict[str, Any]:
    """``calls`` requests of ``size`` bytes through the profiled app; the replica's measurements."""
    handle = serve.run(ProfiledDeployment.bind(node_config, 4), name="profiled", route_prefix="/profiled")
    cell = http_cell("profiled", f"127.0.0.1:{port}/profiled", make_inputs(size, 1, seed=5), MODEL)
    try:
        call = cell.callers[0]
        call(True)
        call(True)
        handle.reports.remote().result()  # the warm-up's
        client_ms = []
        for _ in range(calls):
            began = time.perf_counter()
            call(False)
            client_ms.append((time.perf_counter() - began) * 1e3)
        call(True)
        reports = handle.reports.remote().result()[:calls]
    finally:
        cell.close()
        serve.delete("profiled")
    last = reports[-1]
    stages: dict[str, list[tuple[float, float]]] = {}
    for r in reports:
        for name, start, end in r["stages_ms"]:
            stages.setdefault(name, []).append((start, end))
    timeline = {
        name: (statistics.median(s for s, _ in spans), statistics.median(e for _, e in spans))
        for name, spans in sorted(stages.items(), key=lambda item: statistics.median(s for s, _ in item[1]))
    }
    return {
        "payload_bytes": size,
        "calls": calls,
        "client_p50_ms": statistics.median(client_ms),
        "replica_p50_ms": statistics.median(r["wall_ms"] for r in reports),
        "peak_extra_payloads": max(r["peak_extra_bytes"] for r in reports) / size,
        "alive_at_end_payloads": last["alive_extra_bytes"] / size,
        "body_chunks": last["body_chunks"],
        "timeline_ms": timeline,
        "alive_large": last["alive_large"],
        "cprofile_last": last["cprofile"],
    }


def compare(sizes: tuple[int, ...], rounds: int, budget_s: float, port: int, node_config: Any) -> list[Any]:
    """The three HTTP rows, one caller, per size; records (see the runner)."""
    triton_http = next(iter(ensure_node_actors(node_config).values())).http_url
    serve.run(
        TritonDeployment.options(name="BenchOurs").bind(node_config, 4),
        name="bench-ours",
        route_prefix=ROUTES["ingress-http"],
    )
    start_grpc_behind(node_config)
    urls = {
        "ingress-http": f"127.0.0.1:{port}{ROUTES['ingress-http']}",
        "ingress-http-grpc": f"127.0.0.1:{port}{ROUTES['ingress-http-grpc']}",
        "triton-http": triton_http,
    }
    options = BenchOptions(rounds=rounds, budget_s=budget_s, min_calls=6, warmup=2, serve_concurrency=(1,))
    progress = Progress(len(sizes) * len(HTTP_METHODS) * rounds)
    records = []
    for size in sizes:
        inputs = make_inputs(size, 1, seed=1)
        openers = [(m, lambda m=m, i=inputs: http_cell(m, urls[m], i, MODEL)) for m in HTTP_METHODS]
        records.extend(run_group(openers, size, 1, options, "serve", progress))
    progress.close()
    return records


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": KB, "M": MB}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="16M", help="payload of the profiled request")
    parser.add_argument("--calls", type=int, default=5, help="profiled requests")
    parser.add_argument("--compare", action="store_true", help="the three HTTP rows instead")
    parser.add_argument("--sizes", default="1M,16M", help="payloads of --compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=6.0, help="time per cell, all rounds")
    parser.add_argument("--repository", default=None, help="the native models (built)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--cprofile", action="store_true", help="print the replica's cProfile")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = (
        tuple(_parse_size(s) for s in args.sizes.split(",")) if args.compare else (_parse_size(args.size),)
    )
    node_config = _node_config(args.repository, max(sizes))
    port = free_ports("127.0.0.1", 1)[0]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if args.compare:
            records = compare(sizes, args.rounds, args.budget_s, port, node_config)
            result: Any = [r.__dict__ for r in records]
            print(f"{'payload':>8} {'method':<18} {'MB/s':>9} {'p50 ms':>9}")
            for r in records:
                if r.ok:
                    print(
                        f"{size_label(r.payload_bytes):>8} {r.method:<18} "
                        f"{r.throughput_mb_s:9.1f} {r.p50_ms:9.2f}"
                    )
                else:
                    print(f"{size_label(r.payload_bytes):>8} {r.method:<18} FAILED {r.error}")
        else:
            result = profile(sizes[0], args.calls, port, node_config)
            for key, value in result.items():
                if key not in ("alive_large", "cprofile_last", "timeline_ms"):
                    print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
            print("stages in the replica (median ms from the handler's start: begin .. end):")
            for name, (start, end) in result["timeline_ms"].items():
                print(f"  {name:<16} {start:8.2f} .. {end:8.2f}  ({end - start:.2f} ms)")
            print("allocations of >= half a payload alive when the handler returns:")
            for item in result["alive_large"]:
                ours = [w for w in item["where"] if "ray_triton_shm" in w or "starlette" in w]
                print(f"  {item['bytes'] / MB:8.2f} MB  {' <- '.join(reversed(ours[-4:]))}")
            if args.cprofile:
                print(result["cprofile_last"])
    finally:
        serve.shutdown()
        shutdown_node_actors()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
