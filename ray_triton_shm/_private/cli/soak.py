"""A bounded soak: many concurrent callers, fewer slots, every response checked.

Every request carries a unique tag (the value of ``INPUT0`` of ``add_sub``),
so a slot handed to two callers at once, or an answer delivered to the wrong
caller, shows up as a mismatch rather than passing unnoticed.

Run it with ``make soak`` (2 minutes per target) or::

    ray-triton-shm soak --duration 20 --callers 16 --target client
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import tritonclient.http as httpclient

from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.server import TritonServer

logger = logging.getLogger(__name__)

MODEL = "add_sub"
_WIDTH = 16
_SECOND = np.arange(_WIDTH, dtype=np.int32).reshape(1, _WIDTH)
REPOSITORY = Path(__file__).resolve().parents[3] / "deployments" / "models"

Call = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclasses.dataclass
class SoakReport:
    """What one soak target did.

    Attributes:
        target: ``client``, ``serve-handle`` or ``serve-http``.
        callers: Concurrent callers.
        slots: Slots the callers shared.
        duration_s: Wall time of the run.
        requests: Requests answered (correct or not).
        errors: Requests that raised, by exception type.
        mismatches: Answers that did not belong to their request.
        latencies_ms: Latency of every answered request.
    """

    target: str
    callers: int
    slots: int
    duration_s: float = 0.0
    requests: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    mismatches: int = 0
    latencies_ms: list[float] = dataclasses.field(default_factory=list, repr=False)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def summary(self) -> str:
        """One line with the figures ``docs/reliability.md`` reports."""
        rate = self.requests / self.duration_s if self.duration_s else 0.0
        return (
            f"{self.target}: {self.callers} callers on {self.slots} slots for {self.duration_s:.0f} s: "
            f"{self.requests} requests ({rate:.0f}/s), {self.error_count} errors {self.errors or ''}, "
            f"{self.mismatches} mismatches, p50 {self.percentile(50):.2f} ms, "
            f"p99 {self.percentile(99):.2f} ms, max {max(self.latencies_ms, default=float('nan')):.1f} ms"
        )


def _drive(callers: Sequence[tuple[Call, SoakReport]], duration_s: float) -> None:
    """Run one thread per caller until ``duration_s`` passes; check every answer against its tag.

    Tags are unique across all callers, so answers swapped between paths are caught too.
    """
    tags = itertools.count(1)
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def caller(call: Call, report: SoakReport) -> None:
        while time.monotonic() < stop_at:
            with lock:
                tag = next(tags)
            first = np.full((1, _WIDTH), tag, np.int32)
            started = time.perf_counter()
            try:
                out = call({"INPUT0": first, "INPUT1": _SECOND})
            except Exception as e:
                with lock:
                    report.errors[type(e).__name__] = report.errors.get(type(e).__name__, 0) + 1
                logger.warning("soak request %d failed: %s", tag, e)
                continue
            elapsed = (time.perf_counter() - started) * 1e3
            good = np.array_equal(out["OUTPUT0"], first + _SECOND) and np.array_equal(
                out["OUTPUT1"], first - _SECOND
            )
            with lock:
                report.requests += 1
                report.latencies_ms.append(elapsed)
                if not good:
                    report.mismatches += 1

    threads = [threading.Thread(target=caller, args=pair, name=f"soak-{i}") for i, pair in enumerate(callers)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, report in callers:
        report.duration_s = time.monotonic() - began


def soak_client(duration_s: float, callers: int, slots: int, url: str | None = None) -> SoakReport:
    """Direct :class:`TritonShmClient` callers sharing one pool of ``slots`` slots.

    Args:
        duration_s: How long to run.
        callers: Concurrent threads.
        slots: Slots in the pool (fewer than callers makes them queue).
        url: A running Triton's gRPC address; by default one is started.
    """
    server = None
    if url is None:
        server = TritonServer(ServerConfig(model_repository=str(REPOSITORY), load_models=(MODEL,)))
        server.start()
        url = server.grpc_url
    http_url = server.http_url if server is not None else None
    pools = {MODEL: PoolConfig(slots=slots, max_batch_size=1)}
    try:
        with TritonShmClient(url=url, http_url=http_url, pools=pools) as client:
            client.infer(MODEL, {"INPUT0": _SECOND, "INPUT1": _SECOND})  # pool created before timing

            def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                return client.infer(MODEL, inputs)

            report = SoakReport("client", callers, slots)
            _drive([(call, report)] * callers, duration_s)
            stats = client.pool(MODEL).stats()
            if stats.free != stats.slots:
                report.errors["SlotNotReturned"] = stats.slots - stats.free
            return report
    finally:
        if server is not None:
            server.stop()


def soak_serve(
    duration_s: float, callers: int, slots_per_replica: int, replicas: int = 2
) -> tuple[SoakReport, SoakReport]:
    """Callers through a Serve app on a local Ray: half over the handle, half over HTTP.

    Ray must already be initialised; the app is deleted afterwards.

    Returns:
        The handle report and the HTTP report.
    """
    from ray import serve  # lazy: the client soak runs without Ray

    from ray_triton_shm.serve import build_app  # lazy: loads Ray

    port = free_ports("127.0.0.1", 1)[0]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args: dict[str, Any] = {
        "model_repository": str(REPOSITORY),
        "slots_per_model": slots_per_replica,
        "quarantine_s": 2.0,
        "pools": {MODEL: {"slots": slots_per_replica * replicas, "max_batch_size": 1}},
    }
    handle = serve.run(build_app(args, {"num_replicas": replicas}), name="soak", route_prefix="/")
    try:
        handle.infer.remote(MODEL, {"INPUT0": _SECOND, "INPUT1": _SECOND}).result()

        def via_handle(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return handle.infer.remote(MODEL, inputs).result(timeout_s=60)

        def via_http_factory() -> Call:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
            http = clients.enter_context(client)  # ``clients``: the stack that closes them below

            def via_http(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                request = []
                for name, array in inputs.items():
                    tensor = httpclient.InferInput(name, list(array.shape), "INT32")
                    tensor.set_data_from_numpy(array, binary_data=True)
                    request.append(tensor)
                result = http.infer(MODEL, request)
                return {name: result.as_numpy(name) for name in ("OUTPUT0", "OUTPUT1")}

            return via_http

        slots = slots_per_replica * replicas
        half = max(1, callers // 2)
        by_handle, by_http = SoakReport("serve-handle", half, slots), SoakReport("serve-http", half, slots)
        with contextlib.ExitStack() as clients:  # closed here, not by the garbage collector on a Ray thread
            _drive(
                [(via_handle, by_handle)] * half + [(via_http_factory(), by_http) for _ in range(half)],
                duration_s,
            )
        return by_handle, by_http
    finally:
        serve.delete("soak")


def command(duration_s: float, callers: int, slots: int, target: str, out: TextIO = sys.stdout) -> int:
    """``ray-triton-shm soak``: run the soak against ``target`` (client, serve or all) and print its figures.

    Returns:
        0 when every request was answered correctly, 1 otherwise.
    """
    logging.basicConfig(level=logging.WARNING)
    reports: list[SoakReport] = []
    if target in ("client", "all"):
        reports.append(soak_client(duration_s, callers, slots))
        out.write(reports[-1].summary() + "\n")
        out.flush()
    if target in ("serve", "all"):
        import ray  # lazy: the client soak runs without Ray

        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        try:
            for report in soak_serve(duration_s, callers, max(1, slots // 2)):
                reports.append(report)
                out.write(report.summary() + "\n")
        finally:
            from ray import serve  # lazy: the client soak runs without Ray

            from ray_triton_shm.node import shutdown_node_actors  # lazy: loads Ray

            serve.shutdown()
            shutdown_node_actors()
            ray.shutdown()
    ok = all(r.error_count == 0 and r.mismatches == 0 and r.requests > 0 for r in reports)
    return 0 if ok else 1
