"""External callers of the front-door benchmark: processes of their own, each an unmodified tritonclient.

A :class:`CallerPool` keeps ``n`` worker processes (spawned once, outside Ray);
:meth:`CallerPool.run` has ``k`` of them call one URL for a while, starting
together, every call's output checked against its input (the identity model).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


@dataclass(frozen=True)
class CellResult:
    """One cell: ``calls`` calls of ``size`` bytes by ``callers`` processes in ``wall_s`` seconds."""

    calls: int
    wall_s: float
    p50_ms: float
    size: int
    callers: int
    error: str | None = None

    @property
    def mb_s(self) -> float:
        """Payload megabytes (1e6) per second, all callers together.

        One caller: payload / median latency, which shrugs off stalls caused by
        other load on the machine (as the rest of the benchmark); several: total
        bytes / wall time, since a per-call median would hide their waiting for each other.
        """
        if not self.calls or self.wall_s <= 0:
            return float("nan")
        if self.callers == 1:
            return self.size / (self.p50_ms / 1e3) / 1e6
        return self.calls * self.size / self.wall_s / 1e6


def _client(protocol: str, url: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(url, connection_timeout=300, network_timeout=300)

    return grpcclient.InferenceServerClient(url)


def _call(
    protocol: str, client: Any, model: str, x: np.ndarray, headers: dict[str, str] | None
) -> np.ndarray:
    if protocol == "http":
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
        return client.infer(model, [tensor], outputs=wanted, headers=headers).as_numpy("OUTPUT0")

    tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], headers=headers).as_numpy("OUTPUT0")


def _worker(conn: Any, index: int) -> None:
    """A caller process: runs the cells it is sent until told to stop."""
    clients: dict[tuple[str, str], Any] = {}
    while True:
        job = conn.recv()
        if job is None:
            return
        protocol, url, model, size, warmup, headers = job
        try:
            x = np.random.default_rng(index * 7919 + size).random((1, size // 4), dtype=np.float32)
            client = clients.get((protocol, url))
            if client is None:
                client = clients[(protocol, url)] = _client(protocol, url)
            for _ in range(warmup):
                _check(_call(protocol, client, model, x, headers), x)
            conn.send(("ready", None))
            _, start_at, stop_at = conn.recv()  # go: when to start and stop
            while time.time() < start_at:
                time.sleep(0.001)
            latencies = []
            while True:
                began = time.perf_counter()
                _check(_call(protocol, client, model, x, headers), x)
                latencies.append(time.perf_counter() - began)
                if time.time() >= stop_at:
                    break
            conn.send(("done", (latencies, time.time())))
        except Exception as e:  # reported with the cell
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _check(out: np.ndarray, x: np.ndarray) -> None:
    if out is None or out.shape != x.shape or not np.array_equal(out, x):
        raise AssertionError("an output differs from its input")


class CallerPool:
    """``n`` caller processes (spawned, so nothing of Ray is inherited)."""

    def __init__(self, n: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        for index in range(n):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, index), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(
        self,
        protocol: str,
        urls: list[str],
        model: str,
        size: int,
        callers: int,
        duration_s: float,
        warmup: int = 2,
        headers: dict[str, str] | None = None,
    ) -> CellResult:
        """``callers`` processes call ``urls`` (caller ``i`` the ``i % len(urls)``-th) for ``duration_s``."""
        conns = self._conns[:callers]
        for i, conn in enumerate(conns):
            conn.send((protocol, urls[i % len(urls)], model, size, warmup, headers))
        # Warm-up first (connections made, first calls done), then start together.
        errors = []
        ready = []
        for conn in conns:
            kind, payload = conn.recv()
            if kind == "error":
                errors.append(payload)
            else:
                ready.append(conn)
        start_at = time.time() + 0.2
        stop_at = start_at if errors else start_at + duration_s
        for conn in ready:
            conn.send(("go", start_at, stop_at))
        results = []
        for conn in ready:
            kind, payload = conn.recv()
            if kind == "error":
                errors.append(payload)
            else:
                results.append(payload)
        if errors:
            return CellResult(0, 0.0, float("nan"), size, callers, errors[0])
        latencies = [lat for lats, _ in results for lat in lats]
        ended = max(end for _, end in results)
        return CellResult(len(latencies), ended - start_at, statistics.median(latencies) * 1e3, size, callers)

    @property
    def pids(self) -> list[int]:
        """The caller processes' ids."""
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
