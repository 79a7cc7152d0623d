"""The GPU path on a real local Ray: the node actor, the Serve app (handle and front door) and Ray Data.

One Ray per module, and one Serve app over the native models, plus on a machine
with a GPU the native GPU models (``deployments/native_models_gpu``, built by
``make native``):

* without a GPU (``make test``): ``memory="cuda"`` is refused with the typed
  error that names the pip extra, in a Ray task as in the driver, and
  ``memory="auto"`` falls back to system-memory slots for the node actor, the
  Serve handle, the front door and Ray Data, every answer checked;
* with a GPU (marked ``gpu``; ``tools/gpu/run.sh ray``): the Serve app runs with
  ``memory: cuda``: a cupy tensor reaches the GPU model through the node actor's
  CUDA slots (the probe shows Triton handed the model GPU memory both ways),
  through the handle, the front door and Ray Data with ``memory="cuda"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.helpers import free_port

from .conftest import REPO, frontdoor_on_free_ports, http_identity, teardown_ray

pytestmark = pytest.mark.slow

NATIVE = REPO / "deployments" / "native_models"
NATIVE_GPU = REPO / "deployments" / "native_models_gpu"
N = 4096
SHAPE = {"INPUT0": [N], "OUTPUT0": [N]}


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device
        return 0


GPUS = _gpu_count()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no GPU (cupy sees none)")
without_gpu = pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU: the gpu tests run the CUDA path")


def _app_args() -> dict[str, Any]:
    """The Serve app's args, which the node clients and Ray Data share (one node Triton)."""
    from ray_triton_shm._private.triton.native import require_native_models

    repositories = [require_native_models(str(NATIVE))]
    pools: dict[str, Any] = {"identity": {"slots": 2, "max_batch_size": 2, "max_shapes": SHAPE}}
    if GPUS:
        repositories.append(require_native_models(str(NATIVE_GPU)))
        pools["identity_gpu"] = {"slots": 2, "max_batch_size": 2, "max_shapes": SHAPE}
        pools["probe_gpu"] = {"slots": 1, "max_shapes": SHAPE}
    return {"model_repository": repositories, "pools": pools, "quarantine_s": 1.0}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Local Ray (with the machine's GPUs) and the Serve app: ``memory: cuda`` on a GPU, else ``auto``."""
    import ray

    from ray_triton_shm.serve import run_config_file

    # On GPU nodes the replicas ask for a sliver of a GPU (triton_shm_gpu.yaml), elsewhere for none.
    source = REPO / "deployments" / ("triton_shm_gpu.yaml" if GPUS else "triton_shm.yaml")
    spec = frontdoor_on_free_ports(yaml.safe_load(source.read_text()))
    spec["http_options"]["port"] = free_port()
    spec["grpc_options"]["port"] = free_port()
    application = spec["applications"][0]
    args = _app_args()
    application["args"].update(args, memory="cuda" if GPUS else "auto")
    for deployment in application.get("deployments") or []:
        deployment["num_replicas"] = 1
    path = Path(tmp_path_factory.mktemp("gpu_path")) / "app.yaml"
    path.write_text(yaml.safe_dump(spec))
    with _local_ray():
        handles = run_config_file(str(path))
        door = application["args"]["frontdoor"]
        yield {
            "handle": handles["triton"],
            "args": args,
            "http": f"127.0.0.1:{door['http_port']}",
            "ray": ray,
        }


@contextlib.contextmanager
def _local_ray() -> Iterator[None]:
    """A private local Ray that declares the machine's GPUs; Serve and node actors torn down after."""
    import ray

    ray.init(
        address="local",
        num_cpus=4 if GPUS else 2,
        num_gpus=GPUS,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        teardown_ray()


def _data_identity(ray: Any, args: dict[str, Any], model: str, memory: str, rows: int) -> list[dict]:
    from ray_triton_shm.data import TritonPredictor

    values = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
    ds = ray.data.from_numpy(values).map_batches(lambda b: {"INPUT0": b["data"]}, batch_format="numpy")
    resources = {"num_gpus": 0.1} if memory == "cuda" else {"num_cpus": 0.25}
    return ds.map_batches(
        TritonPredictor,
        fn_constructor_kwargs={
            "model": model,
            "model_repository": args["model_repository"],
            "pools": args["pools"],
            "memory": memory,
        },
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=50,
        batch_format="numpy",
        **resources,
    ).take_all()


# -- without a GPU: memory="cuda" refused, "auto" on system memory ----------------------------


@without_gpu
def test_memory_cuda_without_a_gpu_is_a_typed_error_in_a_ray_task(app: dict[str, Any]) -> None:
    ray = app["ray"]
    args = app["args"]

    @ray.remote(num_cpus=0)
    def cuda_client() -> None:
        from ray_triton_shm.node import NodeClient, NodeConfig

        NodeClient(NodeConfig.from_args(args["model_repository"], pools=args["pools"]), memory="cuda")

    from ray_triton_shm.errors import CudaUnavailableError, NoGpuError

    with pytest.raises((CudaUnavailableError, NoGpuError)) as refused:
        ray.get(cuda_client.remote(), timeout=120)
    text = str(refused.value)
    assert r"ray-triton-shm[cuda]" in text or "sees no GPU" in text, text


@without_gpu
def test_memory_auto_falls_back_to_system_slots_everywhere(app: dict[str, Any]) -> None:
    """Node client in a task, Serve handle, front door, Ray Data: all on system slots, answers checked."""
    ray = app["ray"]
    args = app["args"]

    @ray.remote(num_cpus=0)
    def auto_client() -> tuple[str, bool]:
        from ray_triton_shm.node import NodeClient, NodeConfig

        config = NodeConfig.from_args(args["model_repository"], pools=args["pools"])
        with NodeClient(config, memory="auto") as client:
            x = np.linspace(0, 1, 2 * 300, dtype=np.float32).reshape(2, 300)
            out = client.infer("identity", {"INPUT0": x})
            return out.path, bool(np.array_equal(out["OUTPUT0"], x))

    assert ray.get(auto_client.remote(), timeout=300) == ("shm", True)
    x = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    outputs, origin = app["handle"].infer_with_origin.remote("identity", {"INPUT0": x}).result()
    assert origin["path"] == "shm"
    np.testing.assert_array_equal(outputs["OUTPUT0"], x)
    np.testing.assert_array_equal(http_identity(app["http"], x), x)
    rows = _data_identity(ray, args, "identity", "auto", 200)
    assert len(rows) == 200
    for row in rows:
        np.testing.assert_array_equal(row["OUTPUT0"], row["INPUT0"])


# -- with a GPU: memory="cuda", the GPU model reading the node actor's CUDA slots -------------


@pytest.mark.gpu
@needs_gpu
def test_node_actor_cuda_slots_reach_the_gpu_model_in_place(app: dict[str, Any]) -> None:
    ray = app["ray"]
    args = app["args"]

    # A share of the GPU, not all of it: the Serve replica holds a sliver of GPU 0 (triton_shm_gpu.yaml).
    @ray.remote(num_gpus=0.1, num_cpus=0)
    def on_gpu() -> tuple[str, bool, list[int], str]:
        import cupy

        from ray_triton_shm.node import NodeClient, NodeConfig

        config = NodeConfig.from_args(args["model_repository"], pools=args["pools"])
        with NodeClient(config, memory="cuda") as client:
            x = cupy.random.random((2, 3000), dtype=cupy.float32)
            out = client.infer("identity_gpu", {"INPUT0": x})
            same = isinstance(out["OUTPUT0"], cupy.ndarray) and bool((out["OUTPUT0"] == x).all())
            probed = client.infer("probe_gpu", {"INPUT0": x[0]})
            memory = [int(v) for v in cupy.asnumpy(probed["MEMORY"])]
            return out.path, same and bool((probed["OUTPUT0"] == x[0]).all()), memory, probed.path

    path, same, memory, probe_path = ray.get(on_gpu.remote(), timeout=300)
    assert (path, probe_path, same) == ("cuda_shm", "cuda_shm", True)
    assert memory[0] == 2 and memory[2] == 2, f"Triton handed the GPU model {memory} (type 2 is GPU)"


@pytest.mark.gpu
@needs_gpu
def test_serve_memory_cuda_handle_and_front_door(app: dict[str, Any]) -> None:
    import cupy

    x = cupy.random.random((2, 2000), dtype=cupy.float32)
    outputs, origin = app["handle"].infer_with_origin.remote("identity_gpu", {"INPUT0": x}).result()
    assert origin["path"] == "cuda_shm"
    assert isinstance(outputs["OUTPUT0"], cupy.ndarray)
    cupy.testing.assert_array_equal(outputs["OUTPUT0"], x)
    host = cupy.asnumpy(x)
    np.testing.assert_array_equal(http_identity(app["http"], host, model="identity_gpu"), host)


@pytest.mark.gpu
@needs_gpu
def test_ray_data_memory_cuda_on_the_gpu_model(app: dict[str, Any]) -> None:
    rows = _data_identity(app["ray"], app["args"], "identity_gpu", "cuda", 300)
    assert len(rows) == 300
    for row in rows:
        np.testing.assert_array_equal(row["OUTPUT0"], row["INPUT0"])
