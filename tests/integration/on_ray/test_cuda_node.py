"""CUDA pools granted by the node actor, on a real local Ray with a GPU (skips without cupy or a GPU).

Not run by tools/gpu/run.sh: the lender's GPU machine has no Ray. Run with
``pytest tests/integration/on_ray/test_cuda_node.py`` on a GPU machine that has Ray and cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from .conftest import REPO, teardown_ray

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy() -> Any:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except Exception as e:
        pytest.skip(f"no usable GPU: {e}")
    return cupy


@pytest.fixture(scope="module")
def node(cupy: Any) -> Any:
    import ray

    from ray_triton_shm.config import PoolConfig
    from ray_triton_shm.node import NodeConfig, ensure_node_actors

    shape = {"INPUT0": (4096,), "OUTPUT0": (4096,)}
    config = NodeConfig.for_repository(
        str(REPO / "deployments" / "models"),
        pools={"identity": PoolConfig(slots=4, max_batch_size=2, max_shapes=shape)},
        quarantine_s=0.5,
    )
    gpus = cupy.cuda.runtime.getDeviceCount()
    ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False)
    try:
        infos = ensure_node_actors(config)
        yield config, next(iter(infos.values()))
    finally:
        teardown_ray()


def test_node_actor_sees_the_gpus(node: Any, cupy: Any) -> None:
    _, info = node
    assert info.gpus == cupy.cuda.runtime.getDeviceCount()


def test_gpu_task_gets_a_cuda_pool_from_the_node_actor(node: Any) -> None:
    import ray

    config, _ = node

    @ray.remote(num_gpus=1, num_cpus=0)
    def run_on_gpu() -> tuple[str, bool, str]:
        import os

        import cupy

        from ray_triton_shm.node import NodeClient

        with NodeClient(config, memory="cuda") as client:
            x = cupy.arange(2 * 100, dtype=cupy.float32).reshape(2, 100)
            out = client.infer("identity", {"INPUT0": x})
            same = bool((out["OUTPUT0"] == x).all()) and isinstance(out["OUTPUT0"], cupy.ndarray)
            return out.path, same, os.environ.get("CUDA_VISIBLE_DEVICES", "")

    path, same, visible = ray.get(run_on_gpu.remote(), timeout=300)
    assert path == "cuda_shm" and same, (path, same, visible)


def test_cpu_model_under_auto_gets_system_memory(node: Any) -> None:
    import ray

    config, _ = node

    @ray.remote(num_gpus=1, num_cpus=0)
    def run_auto() -> str:
        from ray_triton_shm.node import NodeClient

        with NodeClient(config, memory="auto") as client:
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            return client.infer("add_sub", {"INPUT0": a, "INPUT1": a}).path

    # add_sub's instances are KIND_CPU: "auto" keeps it in system memory.
    assert ray.get(run_auto.remote(), timeout=300) == "shm"
