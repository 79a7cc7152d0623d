"""CUDA shm vs system shm vs plain gRPC for one large tensor through an identity model.

Run on a GPU machine (needs cupy and a GPU)::

    ray-triton-shm bench-cuda --mb 64                      # the Python identity (runs on the CPU)
    ray-triton-shm bench-cuda --gpu-model --mb 64,256      # identity_gpu (rts_native, KIND_GPU)

Each path sends one FP32 tensor of ``--mb`` megabytes to the model and gets it
back, and checks the answer once. GB/s counts the bytes sent plus the bytes
received per call (2 x size) over the median wall time:

* ``cuda_shm``: cupy input, cupy output, both in a CUDA shared-memory slot;
* ``shm``: numpy input and output in a POSIX shared-memory slot;
* ``grpc``: numpy input and output serialised in the gRPC messages;
* ``d2d`` (``--gpu-model``): no Triton at all, one cupy device-to-device copy of
  the tensor on the same GPU, GB/s counted the same way (2 x size: read and
  written): what the device itself moves, beside what each path achieves.

With ``--gpu-model`` the model is ``identity_gpu`` of
``deployments/native_models_gpu`` (``make native``): through CUDA shared memory
Triton hands it our GPU regions and it copies device to device, so the
``cuda_shm`` row has no host copy on either side.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

import numpy as np

from ray_triton_shm._private.bench.measure import Timing, time_call
from ray_triton_shm._private.shm.cuda import import_cupy, require_device
from ray_triton_shm._private.triton.native import native_gpu_model_repository, require_native_models
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.errors import CudaError
from ray_triton_shm.server import TritonServer

MB = 1 << 20
CPU_MODEL = "identity"
GPU_MODEL = "identity_gpu"
TARGET_MB = 64
TARGET_FACTOR = 5.0  # CUDA shm to the GPU model, over system shm, at TARGET_MB
PATH_ORDER = ("cuda_shm", "shm", "grpc", "d2d")


def _pools(model: str, elements: int, memory: str, device: int) -> dict[str, PoolConfig]:
    shape = (elements,)
    return {
        model: PoolConfig(
            slots=1,
            max_batch_size=1,
            max_shapes={"INPUT0": shape, "OUTPUT0": shape},
            memory=memory,
            device_id=device if memory == "cuda" else None,
        )
    }


def _row(path: str, mb: int, timing: Timing, matched: bool) -> dict[str, Any]:
    return {
        "path": path,
        "mb": mb,
        "median_ms": round(timing.median_s * 1e3, 2),
        "p90_ms": round(timing.percentile_ms(90), 2),
        "gb_per_s": round(timing.payload_bytes / timing.median_s / 1e9, 3),
        "repeats": len(timing.seconds),
        "matched": matched,
    }


def device_copy_row(
    mb: int, *, repeats: int = 10, budget_s: float = 30.0, device: int | None = None
) -> dict[str, Any]:
    """The ``d2d`` row: one cupy device-to-device copy of an ``mb`` MB tensor, synchronised.

    Raises:
        CudaUnavailableError / NoGpuError: No cupy or GPU.
    """
    cupy = import_cupy()
    device = require_device(device)
    nbytes = mb * MB
    with cupy.cuda.Device(device):
        source = cupy.random.random(nbytes // 4, dtype=cupy.float32)
        target = cupy.empty_like(source)
        done = cupy.cuda.Device(device).synchronize

        def copy() -> None:
            target.data.copy_from_device(source.data, nbytes)
            done()

        timing = time_call(copy, 2 * nbytes, warmup=1, repeats=repeats, budget_s=budget_s)
        matched = bool((target == source).all())
    return _row("d2d", mb, timing, matched)


def run_bench(
    url: str,
    mb: int,
    *,
    repeats: int = 10,
    budget_s: float = 60.0,
    device: int | None = None,
    model: str = CPU_MODEL,
) -> list[dict[str, Any]]:
    """Time the three paths against the server at ``url``.

    Args:
        url: The server's gRPC ``host:port``.
        mb: Tensor size in MB.
        repeats: Timed calls per path (fewer when ``budget_s`` runs out).
        budget_s: Seconds each path may spend on its timed calls.
        device: The client's GPU; cupy's current one by default.
        model: An FP32 identity with INPUT0 and OUTPUT0 of one variable dim.

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
        ("cuda_shm", "cuda", lambda c: c.infer(model, {"INPUT0": gpu})),
        ("shm", "system", lambda c: c.infer(model, {"INPUT0": host})),
        ("grpc", "system", lambda c: c.infer_grpc(model, {"INPUT0": host})),
    ]
    for label, memory, call in cases:
        pools = _pools(model, elements, memory, device)
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
        rows.append(_row(label, mb, timing, matched))
    return rows


def with_ratios(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` sorted by size then path, each with ``x_grpc`` and ``x_shm``: its GB/s over that size's.

    A ratio is ``None`` where that size has no such row (or it measured nothing).
    """
    rows = [dict(r) for r in rows]
    speed = {(r["mb"], r["path"]): r["gb_per_s"] for r in rows}
    rank = {path: n for n, path in enumerate(PATH_ORDER)}
    rows.sort(key=lambda r: (r["mb"], rank.get(r["path"], len(rank)), r["path"]))
    for r in rows:
        for key, base in (("x_grpc", "grpc"), ("x_shm", "shm")):
            reference = speed.get((r["mb"], base))
            r[key] = round(r["gb_per_s"] / reference, 2) if reference else None
    return rows


def target_verdict(
    rows: Iterable[dict[str, Any]], mb: int = TARGET_MB, factor: float = TARGET_FACTOR
) -> str | None:
    """Whether CUDA shm reached ``factor`` x system shm at ``mb`` MB, as a line; ``None`` if not measured."""
    speed = {(r["mb"], r["path"]): r for r in rows}
    cuda, shm = speed.get((mb, "cuda_shm")), speed.get((mb, "shm"))
    if cuda is None or shm is None or not shm["gb_per_s"]:
        return None
    ratio = cuda["gb_per_s"] / shm["gb_per_s"]
    verdict = "met" if ratio >= factor and cuda["matched"] and shm["matched"] else "NOT met"
    return f"target: CUDA shm >= {factor:g}x system shm at {mb} MB: {ratio:.2f}x, {verdict}"


def print_table(rows: Sequence[dict[str, Any]], out: TextIO, *, target: bool = False) -> None:
    """Write ``rows`` as an aligned table, each row's speed relative to gRPC and system shm at its size.

    Args:
        rows: Rows of :func:`run_bench` (and :func:`device_copy_row`), of one or more sizes.
        out: Where to write.
        target: Also say whether the CUDA shm target (:func:`target_verdict`) was met.
    """
    table = with_ratios(rows)
    out.write(
        f"{'path':<10}{'MB':>6}{'median ms':>12}{'p90 ms':>10}{'GB/s':>9}{'x grpc':>9}{'x shm':>8}{'ok':>5}\n"
    )
    for r in table:
        x_grpc = "-" if r["x_grpc"] is None else f"{r['x_grpc']:.1f}"
        x_shm = "-" if r["x_shm"] is None else f"{r['x_shm']:.2f}"
        out.write(
            f"{r['path']:<10}{r['mb']:>6}{r['median_ms']:>12}{r['p90_ms']:>10}{r['gb_per_s']:>9}"
            f"{x_grpc:>9}{x_shm:>8}{'yes' if r['matched'] else 'NO':>5}\n"
        )
    out.write("GB/s = (bytes sent + bytes received) / median wall time of one infer call\n")
    if any(r["path"] == "d2d" for r in table):
        out.write("d2d = one cupy device-to-device copy of the tensor, no Triton (bytes read + written)\n")
    verdict = target_verdict(table) if target else None
    if verdict:
        out.write(verdict + "\n")


def command(
    sizes: Sequence[int],
    repeats: int,
    url: str | None,
    model_repository: str | None,
    json_path: str | None,
    *,
    gpu_model: bool = False,
) -> int:
    """``ray-triton-shm bench-cuda``: the three paths at each size, printed (and written to ``json_path``).

    Args:
        sizes: Tensor sizes in MB.
        repeats: Timed calls per path and size.
        url: A running Triton's gRPC ``host:port``; by default one is started.
        model_repository: The models of the started server; by default ``deployments/models``
            (``deployments/native_models_gpu`` with ``gpu_model``).
        json_path: Also write the rows there.
        gpu_model: Measure ``identity_gpu`` (a KIND_GPU instance of the native backend), and
            add the device's own device-to-device copy rate (``d2d``) at each size.

    Returns:
        0 when every answer matched, 1 when one did not, 2 without a GPU.
    """
    try:
        import_cupy()
        require_device(None)
    except CudaError as e:
        what = "the GPU-model rows need a CUDA device" if gpu_model else "bench-cuda needs a GPU"
        sys.stderr.write(f"bench-cuda: no GPU device here, {what}: {e}\n")
        return 2
    model = GPU_MODEL if gpu_model else CPU_MODEL
    rows: list[dict[str, Any]] = []

    def measure(server_url: str) -> None:
        for mb in sizes:
            rows.extend(run_bench(server_url, mb, repeats=repeats, model=model))
            if gpu_model:
                rows.append(device_copy_row(mb, repeats=repeats))

    if url:
        measure(url)
    else:
        if gpu_model:
            repository = require_native_models(model_repository or native_gpu_model_repository())
            config = ServerConfig(model_repository=os.path.abspath(repository), load_models=(model,))
        else:
            # The Python backend's own arena must hold a whole tensor in and out without growing per call.
            arena = 4 * max(sizes) * MB
            config = ServerConfig(
                model_repository=os.path.abspath(model_repository or os.path.join("deployments", "models")),
                load_models=(model,),
                python_shm_default_bytes=arena,
                python_shm_growth_bytes=arena,
            )
        with TritonServer(config) as server:
            sys.stdout.write(f"tritonserver {server.version} ({server.binary_source}); model {model}\n")
            measure(server.grpc_url)
    print_table(rows, sys.stdout, target=gpu_model)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(with_ratios(rows), f, indent=2)
    return 0 if all(r["matched"] for r in rows) else 1
