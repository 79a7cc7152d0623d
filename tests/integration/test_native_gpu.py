"""The native backend's GPU instances (``deployments/native_models_gpu``) against a real Triton.

``identity_gpu`` and ``probe_gpu`` run ``rts_native`` with ``KIND_GPU`` instances:
they ask Triton for GPU memory and move the tensor through their GPU (one
device-to-device copy when both buffers Triton hands over are our CUDA slots).
``probe_gpu`` also answers MEMORY, the memory type and device id of the
buffers Triton handed over, which is how a test sees that no host copy happened.

Everywhere (no GPU needed): Triton refuses the GPU models with a clear message
while the CPU models of the same server keep serving, and the probe's MEMORY
report (only when asked for, the memory types Triton handed over) is checked
on a ``KIND_CPU`` instance. The tests marked ``gpu`` need cupy and a GPU and
skip without them; ``tools/gpu/run.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient
from ray_triton_shm._private.triton.native import BACKEND_LIBRARY, require_native_models

from .conftest import NATIVE_MODEL_REPOSITORY, REPO_ROOT, close_and_check

GPU_MODEL_REPOSITORY = REPO_ROOT / "deployments" / "native_models_gpu"
MEMORY_CPU, MEMORY_CPU_PINNED, MEMORY_GPU = 0, 1, 2
HOST = (MEMORY_CPU, MEMORY_CPU_PINNED)
SENTINEL = np.uint64(0xDEADBEEF)


def _gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (then Triton loads KIND_GPU models)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def _copy_model(source: Path, destination: Path) -> Path:
    """A model directory copied with its built backend (``make native``)."""
    require_native_models(str(source.parent))
    shutil.copytree(source, destination)
    return destination / "config.pbtxt"


def _grpc_load(url: str, model: str) -> None:
    with grpcclient.InferenceServerClient(url) as triton:
        triton.load_model(model)


def _ready(url: str, model: str) -> bool:
    with grpcclient.InferenceServerClient(url) as triton:
        return bool(triton.is_model_ready(model))


# -- everywhere ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_and_gpu_server() -> Iterator[TritonServer]:
    """Triton over the CPU native models and, as a second repository, the GPU ones (loaded on request)."""
    require_native_models(str(NATIVE_MODEL_REPOSITORY))
    require_native_models(str(GPU_MODEL_REPOSITORY))
    config = ServerConfig(
        model_repository=str(NATIVE_MODEL_REPOSITORY),
        load_models=("identity", "probe"),
        extra_args=(f"--model-repository={GPU_MODEL_REPOSITORY}",),
    )
    server = TritonServer(config)
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_alive()


@pytest.mark.parametrize("model", ["identity_gpu", "probe_gpu"])
def test_gpu_models_are_refused_without_a_gpu_and_cpu_models_keep_serving(
    cpu_and_gpu_server: TritonServer, model: str
) -> None:
    if _gpu_visible():
        pytest.skip("this machine has a GPU: the GPU models load here (the gpu tests below)")
    url = cpu_and_gpu_server.grpc_url
    with pytest.raises(InferenceServerException) as refused:
        _grpc_load(url, model)
    message = str(refused.value)
    assert f"of model {model} has kind KIND_GPU but no GPUs are available" in message, message
    assert not _ready(url, model)
    # The CPU models of the same server still load and serve, through shared memory.
    assert _ready(url, "identity")
    shape = {"INPUT0": (512,), "OUTPUT0": (512,)}
    pools = {"identity": PoolConfig(slots=1, max_batch_size=2, max_shapes=shape)}
    client = TritonShmClient(url=url, pools=pools)
    try:
        x = np.arange(2 * 300, dtype=np.float32).reshape(2, 300)
        result = client.infer("identity", {"INPUT0": x})
        assert result.path == "shm"
        np.testing.assert_array_equal(result["OUTPUT0"], x)
    finally:
        close_and_check(client)
    assert cpu_and_gpu_server.is_alive()


def _probe_with_memory(repository: Path) -> None:
    """The CPU probe, with the MEMORY output declared (the GPU probe's config, on a KIND_CPU instance)."""
    config = _copy_model(NATIVE_MODEL_REPOSITORY / "probe", repository / "probe")
    text = config.read_text()
    declared = '{ name: "ADDRESSES", data_type: TYPE_UINT64, dims: [ 4 ] }'
    assert declared in text
    config.write_text(
        text.replace(declared, declared + ',\n  { name: "MEMORY", data_type: TYPE_UINT64, dims: [ 4 ] }')
    )


@pytest.fixture(scope="module")
def memory_probe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("memory_probe")
    _probe_with_memory(repository)
    server = TritonServer(ServerConfig(model_repository=str(repository)))
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_alive()


def test_probe_reports_the_memory_triton_handed_over_only_when_asked(
    memory_probe_server: TritonServer,
) -> None:
    """Through system shm: MEMORY says CPU both ways, and is written only when the request asks for it."""
    pools = {"probe": PoolConfig(slots=1, max_shapes={"INPUT0": (1024,), "OUTPUT0": (1024,)})}
    client = TritonShmClient(url=memory_probe_server.grpc_url, pools=pools)
    try:
        x = np.linspace(0, 1, 700, dtype=np.float32)
        layout = client.layout("probe")
        memory_spec = layout.output("MEMORY")
        assert memory_spec is not None
        for asked in (False, True):
            with client.lease("probe") as lease:
                lease.input("INPUT0", x.shape)[:] = x
                # The slot's MEMORY bytes, set to a value the backend never writes (private view: tests only).
                lease._array(memory_spec, (4,))[:] = SENTINEL
                wanted = ["OUTPUT0", "ADDRESSES", "MEMORY"] if asked else ["OUTPUT0", "ADDRESSES"]
                views = client.run(lease, outputs=wanted)
                np.testing.assert_array_equal(views["OUTPUT0"], x)
                assert int(views["ADDRESSES"][1]) == x.nbytes
                memory = lease._array(memory_spec, (4,)).copy()
                del views
            if asked:
                assert memory.tolist() == [MEMORY_CPU, 0, MEMORY_CPU, 0], memory
            else:
                assert memory.tolist() == [int(SENTINEL)] * 4, "the backend wrote an output nobody asked for"
    finally:
        close_and_check(client)


def test_probe_memory_over_plain_grpc(memory_probe_server: TritonServer) -> None:
    """Plain gRPC: the tensors are in the request and response messages, host memory both ways."""
    x = np.arange(33, dtype=np.float32)
    with grpcclient.InferenceServerClient(memory_probe_server.grpc_url) as triton:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("OUTPUT0", "MEMORY")]
        result = triton.infer("probe", [tensor], outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    memory = result.as_numpy("MEMORY")
    assert memory is not None
    assert memory[0] in HOST and memory[2] in HOST, memory
    assert result.as_numpy("ADDRESSES") is None, "ADDRESSES was not asked for, so Triton must not return it"


# -- GPU --------------------------------------------------------------------------------------

N = 1 << 16  # float32 elements a slot of the GPU pools holds


def _cupy_with_gpu() -> Any:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        pytest.skip(f"no usable GPU: {e}")
    if count == 0:
        pytest.skip("no GPU")
    return cupy


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[TritonServer]:
    """Triton over ``deployments/native_models_gpu`` (GPU instances on device 0)."""
    _cupy_with_gpu()
    server = TritonServer(ServerConfig(model_repository=require_native_models(str(GPU_MODEL_REPOSITORY))))
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_alive()


def _gpu_pools(memory: str) -> dict[str, PoolConfig]:
    shape = {"INPUT0": (N,), "OUTPUT0": (N,)}
    device = 0 if memory == "cuda" else None
    return {
        "identity_gpu": PoolConfig(
            slots=2, max_batch_size=2, max_shapes=shape, memory=memory, device_id=device
        ),
        "probe_gpu": PoolConfig(slots=1, max_shapes=shape, memory=memory, device_id=device),
    }


@pytest.fixture
def gpu_client(gpu_server: TritonServer) -> Iterator[TritonShmClient]:
    client = TritonShmClient(url=gpu_server.grpc_url, http_url=gpu_server.http_url, pools=_gpu_pools("cuda"))
    yield client
    client.close()
    with grpcclient.InferenceServerClient(gpu_server.grpc_url) as triton:
        assert not triton.get_cuda_shared_memory_status(as_json=True).get("regions"), "CUDA regions left"


@pytest.mark.gpu
def test_cupy_reaches_the_gpu_model_in_place(gpu_client: TritonShmClient) -> None:
    """A cupy tensor in a CUDA slot, the GPU model reading and writing the slots: no host copy either side."""
    cupy = _cupy_with_gpu()
    x = cupy.random.random((2, 5000), dtype=cupy.float32)
    out = gpu_client.infer("identity_gpu", {"INPUT0": x})
    assert out.path == "cuda_shm"
    assert isinstance(out["OUTPUT0"], cupy.ndarray)
    cupy.testing.assert_array_equal(out["OUTPUT0"], x)
    # The probe says what Triton handed the model: our GPU regions themselves, on device 0.
    y = cupy.arange(N, dtype=cupy.float32) * 0.25
    probed = gpu_client.infer("probe_gpu", {"INPUT0": y})
    cupy.testing.assert_array_equal(probed["OUTPUT0"], y)
    memory = cupy.asnumpy(probed["MEMORY"]).tolist()
    assert memory == [MEMORY_GPU, 0, MEMORY_GPU, 0], memory
    in_addr, in_bytes, out_addr, out_bytes = cupy.asnumpy(probed["ADDRESSES"]).tolist()
    assert in_bytes == out_bytes == y.nbytes and in_addr and out_addr and in_addr != out_addr


@pytest.mark.gpu
def test_gpu_model_views_and_split_batches(gpu_client: TritonShmClient) -> None:
    cupy = _cupy_with_gpu()
    x = cupy.random.random((5, 300), dtype=cupy.float32)  # slots of 2 rows: three chunks
    out = gpu_client.infer("identity_gpu", {"INPUT0": x})
    cupy.testing.assert_array_equal(out["OUTPUT0"], x)
    with gpu_client.lease("identity_gpu") as lease:
        lease.input("INPUT0", (2, 64))[:] = cupy.full((2, 64), 3.5, dtype=cupy.float32)
        views = gpu_client.run(lease)
        cupy.testing.assert_array_equal(views["OUTPUT0"], cupy.full((2, 64), 3.5, dtype=cupy.float32))
        del views


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["shm", "grpc"])
def test_host_memory_passes_through_the_gpu_model(gpu_server: TritonServer, path: str) -> None:
    """System shm and plain gRPC: Triton hands the GPU model host memory; it goes through the GPU and back."""
    _cupy_with_gpu()
    client = TritonShmClient(url=gpu_server.grpc_url, pools=_gpu_pools("system"))
    try:
        x = np.random.default_rng(3).random((1, 3000), dtype=np.float32)
        result = (
            client.infer("identity_gpu", {"INPUT0": x})
            if path == "shm"
            else client.infer_grpc("identity_gpu", {"INPUT0": x})
        )
        assert result.path == path
        np.testing.assert_array_equal(result["OUTPUT0"], x)
        probed = (
            client.infer("probe_gpu", {"INPUT0": x[0]})
            if path == "shm"
            else client.infer_grpc("probe_gpu", {"INPUT0": x[0]})
        )
        np.testing.assert_array_equal(probed["OUTPUT0"], x[0])
        memory = np.asarray(probed["MEMORY"]).tolist()
        assert memory[0] in HOST and memory[2] in HOST, memory
    finally:
        close_and_check(client)


@pytest.mark.gpu
def test_gpu_instance_logs_its_device_and_routes(tmp_path: Path) -> None:
    """The backend's log: the instance's GPU at load, and at unload how many bytes went device to device."""
    cupy = _cupy_with_gpu()
    repository = tmp_path / "models"
    _copy_model(GPU_MODEL_REPOSITORY / "identity_gpu", repository / "identity_gpu")
    with TritonServer(ServerConfig(model_repository=str(repository))) as server:
        pools = {"identity_gpu": _gpu_pools("cuda")["identity_gpu"]}
        with TritonShmClient(url=server.grpc_url, pools=pools) as client:
            x = cupy.ones((1, 4096), dtype=cupy.float32)
            for _ in range(3):
                cupy.testing.assert_array_equal(client.infer("identity_gpu", {"INPUT0": x})["OUTPUT0"], x)
        assert "model 'identity_gpu' instance" in server.log_tail() and "runs on GPU 0" in server.log_tail()
        with grpcclient.InferenceServerClient(server.grpc_url) as triton:
            triton.unload_model("identity_gpu")
        log = ""
        for _ in range(100):  # the unload finishes after the call returns
            log = server.log_tail()
            if "copied device-to-device" in log:
                break
            time.sleep(0.1)
    routes = re.search(r"copied device-to-device (\d+) buffers (\d+) bytes; host-to-device (\d+)", log)
    assert routes, log[-2000:]
    assert int(routes.group(1)) == 3 and int(routes.group(2)) == 3 * x.nbytes
    assert int(routes.group(3)) == 0, "a CUDA slot's input was copied from host"


@pytest.mark.gpu
def test_a_missing_cuda_driver_fails_the_gpu_model_with_the_backends_message(tmp_path: Path) -> None:
    """A GPU instance whose driver library cannot be opened fails its model's load, naming the library."""
    _cupy_with_gpu()
    repository = tmp_path / "models"
    config = _copy_model(GPU_MODEL_REPOSITORY / "identity_gpu", repository / "identity_gpu")
    config.write_text(
        config.read_text()
        + 'parameters { key: "cuda_driver" value: { string_value: "libcuda_rts_missing.so.1" } }\n'
    )
    _copy_model(NATIVE_MODEL_REPOSITORY / "identity", repository / "identity")
    config_cpu = ServerConfig(model_repository=str(repository), load_models=("identity",))
    with TritonServer(config_cpu) as server:
        with pytest.raises(InferenceServerException) as refused:
            _grpc_load(server.grpc_url, "identity_gpu")
        message = str(refused.value)
        assert "cannot load the CUDA driver library 'libcuda_rts_missing.so.1'" in message, message
        assert "a GPU instance needs a CUDA device" in message, message
        assert _ready(server.grpc_url, "identity")


@pytest.mark.gpu
def test_multi_io_on_a_gpu_instance_is_refused(tmp_path: Path) -> None:
    _cupy_with_gpu()
    repository = tmp_path / "models"
    config = _copy_model(NATIVE_MODEL_REPOSITORY / "multi_io", repository / "multi_io")
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    _copy_model(NATIVE_MODEL_REPOSITORY / "identity", repository / "identity")
    with TritonServer(ServerConfig(model_repository=str(repository), load_models=("identity",))) as server:
        with pytest.raises(InferenceServerException, match="op multi_io runs on KIND_CPU instances only"):
            _grpc_load(server.grpc_url, "multi_io")


def test_the_gpu_models_use_the_backend_make_native_builds() -> None:
    """Each GPU model is KIND_GPU on rts_native, with the library ``make native`` put in its version dir."""
    configs = sorted(GPU_MODEL_REPOSITORY.glob("*/config.pbtxt"))
    assert [c.parent.name for c in configs] == ["identity_gpu", "probe_gpu"]
    for config in configs:
        text = config.read_text()
        assert 'backend: "rts_native"' in text and "kind: KIND_GPU" in text
        assert (config.parent / "1" / BACKEND_LIBRARY).is_file(), "run `make native`"
    assert "KIND_GPU" not in "".join(c.read_text() for c in NATIVE_MODEL_REPOSITORY.glob("*/config.pbtxt"))
