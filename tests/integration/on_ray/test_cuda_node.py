"""CUDA pools granted by the node actor, on a real local Ray.

The first test (the actor's GPU environment) runs everywhere; the others need
a GPU and skip cleanly without cupy or one. ``tools/gpu/run.sh ray`` runs them on a
GPU machine with the Ray it carries (docs/cuda.md), or run
``pytest tests/integration/on_ray/test_cuda_node.py`` on a GPU machine that has Ray and cupy.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from .conftest import REPO, teardown_ray

pytestmark = pytest.mark.slow


def test_node_actor_keeps_the_nodes_gpus_where_ray_would_blank_them() -> None:
    """Ray versions that set CUDA_VISIBLE_DEVICES="" for zero-GPU workers must not do it to the node actor.

    The driver (and so the raylet and its workers) runs with the old Ray default
    forced on, RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, and two GPU ids declared
    (no GPU is needed: Ray only hands out the ids). A plain zero-GPU actor then
    sees no GPU; the node actor, and the Triton it starts, must see both.
    """
    import ray

    from ray_triton_shm.node import NodeConfig, ensure_node_actors, get_node_actor

    saved = {
        name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO")
    }
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"
    try:
        ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)

        @ray.remote(num_cpus=0, num_gpus=0)
        class Plain:
            def visible(self) -> str | None:
                return os.environ.get("CUDA_VISIBLE_DEVICES")

        assert ray.get(Plain.remote().visible.remote(), timeout=120) == ""  # the control: Ray blanks it

        config = NodeConfig.for_repository(str(REPO / "deployments" / "models"))
        info = next(iter(ensure_node_actors(config).values()))
        actor = get_node_actor(config)
        env = ray.get(actor.__ray_call__.remote(lambda self: dict(os.environ)), timeout=120)
        assert env.get("CUDA_VISIBLE_DEVICES") == "0,1", env.get("CUDA_VISIBLE_DEVICES")
        assert info.gpu_visible_devices == "0,1"  # what Triton inherits and clients map against
        with open(f"/proc/{info.triton_pid}/environ", "rb") as f:
            triton_env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert triton_env.get(b"CUDA_VISIBLE_DEVICES") == b"0,1"
    finally:
        teardown_ray()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


@pytest.mark.gpu
def test_node_actor_sees_the_gpus(node: Any, cupy: Any) -> None:
    _, info = node
    assert info.gpus == cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
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


@pytest.mark.gpu
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
