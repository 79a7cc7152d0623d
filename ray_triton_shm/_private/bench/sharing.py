"""What sharing slots between processes costs per request: a pool with and without its slot table.

Node pools are shared on demand: every lease takes its slot in the pool's slot
table (a kernel lock and a word of state) and every release gives it back.
This measures that cost where it weighs most, on small requests: two clients
of one Triton, the same model and payload, one with private slots (no slot
table) and one whose pool is shared through a slot table; rounds alternate
between them. ::

    ray-triton-shm bench-sharing --size 4096 --rounds 6

Prints each round's p50 and the ratio of the medians (shared / private).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm._private.triton.repository import resolve_repositories
from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.server import TritonServer

MODEL = "identity"


def _p50_ms(client: TritonShmClient, x: np.ndarray, calls: int) -> float:
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        out = client.infer(MODEL, {"INPUT0": x})
        latencies.append(time.perf_counter() - start)
        if out.path != "shm":
            raise RuntimeError(f"request went over {out.path}, not shm")
    return statistics.median(latencies) * 1e3


def table_cost_us(iterations: int = 20000) -> float:
    """Microseconds one lease's claim and release of a slot add, measured alone."""
    table = SlotTable.create(new_segment_name("slots"), slots=2, quarantine_s=30.0)
    try:
        start = time.perf_counter()
        for _ in range(iterations):
            if not table.try_claim(0):
                raise RuntimeError("slot 0 not free")
            table.release(0)
        return (time.perf_counter() - start) / iterations * 1e6
    finally:
        table.close()


def run(repository: str, size: int, rounds: int, calls: int) -> dict[str, object]:
    """Alternate private and shared rounds; returns the p50s by round and the ratio of medians."""
    elements = max(1, size // 4)
    pools = {
        MODEL: PoolConfig(
            slots=2, max_shapes={"INPUT0": (elements,), "OUTPUT0": (elements,)}, min_shm_bytes=0
        )
    }
    x = np.random.default_rng(0).random((1, elements), dtype=np.float32)
    with TritonServer(ServerConfig(model_repository=repository)) as server:
        kwargs = {"url": server.grpc_url, "http_url": server.http_url, "pools": pools}
        with TritonShmClient(**kwargs) as private, TritonShmClient(**kwargs) as shared:
            table = SlotTable.create(new_segment_name("slots"), slots=2, quarantine_s=30.0)
            shared.pool(MODEL).share(table)  # the pool closes the table with itself
            for client in (private, shared):
                out = client.infer(MODEL, {"INPUT0": x})
                if not np.array_equal(out["OUTPUT0"], x):
                    raise RuntimeError("wrong output")
                _p50_ms(client, x, calls // 4)  # warm-up
            results: dict[str, list[float]] = {"private": [], "shared": []}
            for index in range(rounds):
                order = ("private", "shared") if index % 2 == 0 else ("shared", "private")
                for name in order:
                    results[name].append(_p50_ms(private if name == "private" else shared, x, calls))
    ratio = statistics.median(results["shared"]) / statistics.median(results["private"])
    per_round = [s / p for s, p in zip(results["shared"], results["private"])]
    return {
        "size": size,
        "p50_ms_by_round": results,
        "ratio_shared_to_private": ratio,
        "ratio_by_round": per_round,
        "table_us_per_request": table_cost_us(),
    }


def command(
    model_repository: str | None, size: int, rounds: int, calls: int, write: Callable[[str], None]
) -> int:
    """``ray-triton-shm bench-sharing``: run :func:`run` on ``model_repository`` and write its figures.

    Raises:
        ConfigError: ``model_repository`` does not exist.
    """
    repository = resolve_repositories(model_repository)
    result = run(repository, size, rounds, calls)  # type: ignore[arg-type]
    for name, p50s in result["p50_ms_by_round"].items():  # type: ignore[union-attr]
        write(f"{name:8s} p50 by round (ms): " + " ".join(f"{v:.3f}" for v in p50s))
    write("shared / private by round: " + " ".join(f"{r:.3f}" for r in result["ratio_by_round"]))  # type: ignore[union-attr]
    write(f"{size} B: shared / private p50 = {result['ratio_shared_to_private']:.3f}")
    write(f"slot table claim + release alone: {result['table_us_per_request']:.2f} us per request")
    return 0
