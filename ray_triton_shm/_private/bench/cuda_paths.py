"""CUDA shm vs system shm vs plain gRPC for one large tensor through ``identity``.

Run on a GPU machine (needs cupy and a GPU)::

    ray-triton-shm bench-cuda --mb 64

Each path sends one FP32 tensor of ``--mb`` megabytes to the ``identity``
model and gets it back, and checks the answer once. GB/s counts the bytes
sent plus the bytes received per call (2 x size) over the median wall time:

* ``cuda_shm``: cupy input, cupy output, both in a CUDA shared-memory slot;
* ``shm``: numpy input and output in a POSIX shared-memory slot;
* ``grpc``: numpy input and output serialised in the gRPC messages.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

from ray_triton_shm._private.bench.measure import time_call
from ray_triton_shm._private.shm.cuda import import_cupy, require_device
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.errors import CudaError
from ray_triton_shm.server import TritonServer

MB = 1 << 20


def _pools(elements: int, memory: str, device: int) -> dict[str, PoolConfig]:
    shape = (elements,)
    return {
        "identity": PoolConfig(
            slots=1,
            max_batch_size=1,
            max_shapes={"INPUT0": shape, "OUTPUT0": shape},
            memory=memory,
            device_id=device if memory == "cuda" else None,
        )
    }


def run_bench(
    url: str, mb: int, *, repeats: int = 10, budget_s: float = 60.0, device: int | None = None
) -> list[dict[str, Any]]:
    """Time the three paths against the server at ``url``.

    Returns:
        One row per path: path, MB, median ms, p90 ms, GB/s, repetitions, whether the output matched.

    Raises:
        CudaUnavailableError / NoGpuError: No cupy or GPU.
    """
    cupy = import_cupy()
    device = require_device(device)
    elements = mb * MB // 4
    host = np.random.default_rng(0).random((1, elements), dtype=np.float32)
    with cupy.cuda.Device(device):
        gpu = cupy.asarray(host)
    rows = []
    cases: list[tuple[str, str, Callable[[TritonShmClient], Any]]] = [
        ("cuda_shm", "cuda", lambda c: c.infer("identity", {"INPUT0": gpu})),
        ("shm", "system", lambda c: c.infer("identity", {"INPUT0": host})),
        ("grpc", "system", lambda c: c.infer_grpc("identity", {"INPUT0": host})),
    ]
    for label, memory, call in cases:
        pools = _pools(elements, memory, device)
        with TritonShmClient(url=url, pools=pools, request_timeout_s=300.0) as client:
            first = call(client)
            out = first["OUTPUT0"]
            got = cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else np.asarray(out)
            matched = bool(np.array_equal(got, host)) and first.path == label
            sync = cupy.cuda.Device(device).synchronize if memory == "cuda" else None

            def timed(c: TritonShmClient = client, run: Callable[..., Any] = call, wait: Any = sync) -> None:
                run(c)
                if wait is not None:
                    wait()

            timing = time_call(timed, 2 * host.nbytes, warmup=1, repeats=repeats, budget_s=budget_s)
        rows.append(
            {
                "path": label,
                "mb": mb,
                "median_ms": round(timing.median_s * 1e3, 2),
                "p90_ms": round(timing.percentile_ms(90), 2),
                "gb_per_s": round(timing.payload_bytes / timing.median_s / 1e9, 3),
                "repeats": len(timing.seconds),
                "matched": matched,
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    """Write ``rows`` as an aligned table, with each path's speed relative to plain gRPC."""
    grpc = next((r["gb_per_s"] for r in rows if r["path"] == "grpc"), None)
    out.write(f"{'path':<10}{'MB':>6}{'median ms':>12}{'p90 ms':>10}{'GB/s':>9}{'x grpc':>9}{'ok':>5}\n")
    for r in rows:
        ratio = f"{r['gb_per_s'] / grpc:.1f}" if grpc else "-"
        out.write(
            f"{r['path']:<10}{r['mb']:>6}{r['median_ms']:>12}{r['p90_ms']:>10}{r['gb_per_s']:>9}"
            f"{ratio:>9}{'yes' if r['matched'] else 'NO':>5}\n"
        )
    out.write("GB/s = (bytes sent + bytes received) / median wall time of one infer call\n")


def command(mb: int, repeats: int, url: str | None, model_repository: str, json_path: str | None) -> int:
    """``ray-triton-shm bench-cuda``: the three paths at ``mb`` MB, printed (and written to ``json_path``).

    Returns:
        0 when every answer matched, 1 when one did not, 2 without a GPU.
    """
    try:
        import_cupy()
        require_device(None)
    except CudaError as e:
        sys.stderr.write(f"bench_cuda needs a GPU: {e}\n")
        return 2
    if url:
        rows = run_bench(url, mb, repeats=repeats)
    else:
        # The Python backend's own arena must hold a whole tensor in and out without growing per call.
        arena = 4 * mb * MB
        config = ServerConfig(
            model_repository=os.path.abspath(model_repository),
            load_models=("identity",),
            python_shm_default_bytes=arena,
            python_shm_growth_bytes=arena,
        )
        with TritonServer(config) as server:
            sys.stdout.write(f"tritonserver {server.version} ({server.binary_source})\n")
            rows = run_bench(server.grpc_url, mb, repeats=repeats)
    print_table(rows, sys.stdout)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["matched"] for r in rows) else 1
