"""The demo behind ``make demo``: the example models through shm and plain gRPC."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ray_triton_shm._private.bench.measure import time_call
from ray_triton_shm._private.triton.native import native_model_repository, require_native_models
from ray_triton_shm._private.triton.repository import examples_repository
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.server import TritonServer

logger = logging.getLogger(__name__)

MB = 1024 * 1024
IDENTITY_MAX = 32 * MB  # float32 elements: 128 MB


def demo_pools() -> dict[str, PoolConfig]:
    return {
        "identity": PoolConfig(
            slots=2,
            max_batch_size=1,
            max_shapes={"INPUT0": (IDENTITY_MAX,), "OUTPUT0": (IDENTITY_MAX,)},
        ),
    }


@dataclass(frozen=True)
class Case:
    """One demo row: a model and inputs, and the outputs we expect."""

    label: str
    model: str
    inputs: dict[str, np.ndarray]
    expected: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.inputs.values())


def demo_cases(rng: np.random.Generator) -> list[Case]:
    """Example models over a range of payload sizes, each with a numpy oracle."""
    a = rng.integers(-1000, 1000, size=(8, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, size=(8, 16), dtype=np.int32)
    image = rng.random((8, 3, 224, 224), dtype=np.float32)
    ints = rng.integers(0, 100, size=(8, 10), dtype=np.int32)
    cases = [
        Case(
            "add_sub int32 8x16",
            "add_sub",
            {"INPUT0": a, "INPUT1": b},
            lambda i: {"OUTPUT0": i["INPUT0"] + i["INPUT1"], "OUTPUT1": i["INPUT0"] - i["INPUT1"]},
        ),
        Case(
            "multi_io 8x3x224x224",
            "multi_io",
            {"INPUT0": image, "INPUT1": ints},
            lambda i: {
                "OUTPUT0": i["INPUT0"].reshape(-1, 512, 294).sum(-1, dtype=np.float32),
                "OUTPUT1": i["INPUT1"].reshape(-1, 5, 2).sum(-1, dtype=np.int32),
            },
        ),
    ]
    for size in (4 * 1024, MB, 16 * MB, 128 * MB):
        x = rng.random((1, size // 4), dtype=np.float32)
        label = f"identity {size // MB} MB" if size >= MB else f"identity {size // 1024} KB"
        cases.append(Case(label, "identity", {"INPUT0": x}, lambda i: {"OUTPUT0": i["INPUT0"]}))
    return cases


def _matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(
        got[k].shape == want[k].shape and np.allclose(got[k], want[k], rtol=1e-4) for k in want
    )


def run_demo(
    model_repository: str | None = None, *, quick: bool = False, native_repository: str | None = None
) -> list[dict[str, object]]:
    """Start the embedded Triton, run every case both ways, print a table.

    By default two servers run in turn: first the native models
    (``deployments/native_models``, the C backend that reads and writes our
    slots in place), then the Python backend's examples; their rows are
    printed native first. An explicit ``model_repository`` runs that one only.

    Args:
        model_repository: Models to serve; the repo's examples (and the native ones) by default.
        quick: Fewer repetitions.
        native_repository: The native models, when ``model_repository`` is not given.

    Returns:
        One row per server and case: server, label, bytes, MB/s over shm and gRPC, whether outputs matched.

    Raises:
        RuntimeError: An output did not match its expected value.
        ServerStartError: The native backend is not built (``make native``).
    """
    rng = np.random.default_rng(0)
    cases = demo_cases(rng)
    runs: list[tuple[str, str, list[Case]]] = []
    if model_repository is None:
        native_models = {"identity", "multi_io"}
        if native_repository is None and not os.path.isdir(native_model_repository()):
            # An installed package: the C backend is built from a checkout (`make native`).
            print("native backend: not in an installed package (`make native` in a checkout); rows skipped")
        else:
            runs.append(
                (
                    "native",
                    require_native_models(native_repository),
                    [c for c in cases if c.model in native_models],
                )
            )
    runs.append(("python", model_repository or examples_repository(), cases))
    rows: list[dict[str, object]] = []
    for server_name, repository, server_cases in runs:
        rows += _run_cases(server_name, repository, server_cases, repeats=3 if quick else 7)
    print_table(rows)
    bad = [f"{r['server']} {r['case']}" for r in rows if not r["outputs_match"]]
    if bad:
        raise RuntimeError(f"outputs did not match for: {bad}")
    return rows


def _run_cases(server_name: str, repository: str, cases: list[Case], repeats: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    config = ServerConfig(model_repository=repository)
    print(f"starting Triton ({server_name} backend) from {config.model_repository} ...", flush=True)
    with (
        TritonServer(config) as server,
        TritonShmClient(url=server.grpc_url, http_url=server.http_url, pools=demo_pools()) as client,
    ):
        print(f"tritonserver {server.version} ({server.binary_source}) at {server.grpc_url}", flush=True)
        for number, case in enumerate(cases, 1):
            want = case.expected(case.inputs)
            shm_out = client.infer(case.model, case.inputs)
            grpc_out = client.infer_grpc(case.model, case.inputs)
            ok = _matches(shm_out, want) and _matches(grpc_out, want)
            big = case.nbytes >= 64 * MB
            shm = time_call(
                lambda c=case: client.infer(c.model, c.inputs),
                case.nbytes,
                warmup=1,
                repeats=repeats,
                budget_s=8,
            )
            grpc = time_call(
                lambda c=case: client.infer_grpc(c.model, c.inputs),
                case.nbytes,
                warmup=0 if big else 1,
                repeats=2 if big else repeats,
                budget_s=8,
            )
            rows.append(
                {
                    "server": server_name,
                    "case": case.label,
                    "bytes": case.nbytes,
                    "path": shm_out.path,
                    "shm_mb_s": shm.mb_per_s,
                    "grpc_mb_s": grpc.mb_per_s,
                    "shm_p50_ms": shm.percentile_ms(50),
                    "grpc_p50_ms": grpc.percentile_ms(50),
                    "outputs_match": ok,
                }
            )
            bar = "#" * number + "." * (len(cases) - number)
            print(f"  [{bar}] {number}/{len(cases)} {case.label}", flush=True)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        f"{'server':<7} {'case':<24} {'payload':>10} {'shm MB/s':>10} {'gRPC MB/s':>10} "
        f"{'speedup':>8} {'shm p50 ms':>11} {'gRPC p50 ms':>12}  ok"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = float(r["shm_mb_s"]) / float(r["grpc_mb_s"])
        print(
            f"{r.get('server', '')!s:<7} {r['case']:<24} {_size(int(r['bytes'])):>10} "
            f"{float(r['shm_mb_s']):>10.1f} "
            f"{float(r['grpc_mb_s']):>10.1f} {speed:>7.1f}x {float(r['shm_p50_ms']):>11.2f} "
            f"{float(r['grpc_p50_ms']):>12.2f}  {'yes' if r['outputs_match'] else 'NO'}"
        )
    print()


def _size(n: int) -> str:
    if n >= MB:
        return f"{n / MB:.1f} MB"
    return f"{n / 1024:.1f} KB"
