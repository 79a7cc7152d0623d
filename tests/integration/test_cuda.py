"""CUDA shared memory against a real Triton.

The tests marked ``gpu`` need cupy and a GPU and skip cleanly without them;
``tools/gpu/run.sh`` runs them on a GPU machine (see docs/cuda.md). The
others run everywhere: they check what happens without cupy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient
from ray_triton_shm.errors import CudaError, CudaUnavailableError, DeviceMappingError

from .conftest import MODEL_REPOSITORY, REPO_ROOT

N = 4096  # largest variable dim of identity and affine in these pools


def _cuda_pools(**overrides: Any) -> dict[str, PoolConfig]:
    shape = {"INPUT0": (N,), "OUTPUT0": (N,)}
    return {
        "identity": PoolConfig(slots=2, max_batch_size=2, max_shapes=shape, memory="cuda", **overrides),
        # OUTPUT0 = 1 - 2 * INPUT0: an answer read from the input region (or a stale slot) cannot pass.
        "affine": PoolConfig(slots=2, max_batch_size=2, max_shapes=shape, memory="cuda", **overrides),
        "add_sub": PoolConfig(slots=1, memory="cuda", **overrides),
    }


def _regions(url: str) -> tuple[list[str], list[str]]:
    """Names of the CUDA and system regions Triton has registered."""
    with grpcclient.InferenceServerClient(url) as grpc:
        cuda = grpc.get_cuda_shared_memory_status(as_json=True).get("regions", {})
        system = grpc.get_system_shared_memory_status(as_json=True).get("regions", {})
    return sorted(cuda), sorted(system)


# -- everywhere: no cupy ----------------------------------------------------------------


def test_cuda_pool_without_cupy_raises_and_registers_nothing(
    make_client: Callable[..., TritonShmClient], triton_server: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    cuda_before, system_before = _regions(triton_server.grpc_url)
    pools = {"identity": _cuda_pools()["identity"], "add_sub": PoolConfig(slots=1)}
    client = make_client(pools=pools)
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with pytest.raises(CudaUnavailableError, match=r"ray-triton-shm\[cuda\]"):
        client.infer("identity", {"INPUT0": x})
    assert _regions(triton_server.grpc_url) == (cuda_before, system_before)
    assert client.pool_stats() == []
    # Other models of the same client keep working through system memory.
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    assert out.path == "shm"
    np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)


# -- GPU ------------------------------------------------------------------------------------


def _cupy_with_gpu() -> Any:
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        pytest.skip(f"no usable GPU: {e}")
    if count == 0:
        pytest.skip("no GPU")
    return cupy


@pytest.fixture
def cupy() -> Any:
    return _cupy_with_gpu()


@pytest.fixture
def cuda_client(
    cupy: Any, make_client: Callable[..., TritonShmClient], triton_server: TritonServer
) -> Iterator[TritonShmClient]:
    client = make_client(pools=_cuda_pools())
    yield client
    client.close()
    assert _regions(triton_server.grpc_url)[0] == [], "CUDA regions still registered after close"


@pytest.mark.gpu
def test_cupy_round_trip(cupy: Any, cuda_client: TritonShmClient) -> None:
    x = cupy.arange(2 * N, dtype=cupy.float32).reshape(2, N) * 0.5
    out = cuda_client.infer("affine", {"INPUT0": x})
    assert out.path == "cuda_shm"
    assert isinstance(out["OUTPUT0"], cupy.ndarray)
    assert out["OUTPUT0"].shape == (2, N)
    cupy.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)
    assert cuda_client.pool("affine").memory == "cuda"


@pytest.mark.gpu
def test_add_sub_two_outputs_on_gpu(cupy: Any, cuda_client: TritonShmClient) -> None:
    a = cupy.arange(3 * 16, dtype=cupy.int32).reshape(3, 16)
    b = cupy.full((3, 16), 7, dtype=cupy.int32)
    out = cuda_client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
    assert out.path == "cuda_shm"
    cupy.testing.assert_array_equal(out["OUTPUT0"], a + b)
    cupy.testing.assert_array_equal(out["OUTPUT1"], a - b)


@pytest.mark.gpu
def test_numpy_input_into_cuda_slot(cupy: Any, cuda_client: TritonShmClient) -> None:
    x = np.random.default_rng(1).random((1, 1000), dtype=np.float32)
    out = cuda_client.infer("identity", {"INPUT0": x})
    assert out.path == "cuda_shm"
    np.testing.assert_array_equal(cupy.asnumpy(out["OUTPUT0"]), x)


@pytest.mark.gpu
def test_non_contiguous_cupy_input(cupy: Any, cuda_client: TritonShmClient) -> None:
    base = cupy.arange(2 * 2 * 300, dtype=cupy.float32).reshape(2, 600)
    x = base[:, ::2]  # a strided view: copied contiguous on the device first
    out = cuda_client.infer("identity", {"INPUT0": x})
    cupy.testing.assert_array_equal(out["OUTPUT0"], x)


@pytest.mark.gpu
def test_torch_dlpack_input(cupy: Any, cuda_client: TritonShmClient) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    x = torch.linspace(0, 1, 2 * 777, device="cuda", dtype=torch.float32).reshape(2, 777)
    out = cuda_client.infer("identity", {"INPUT0": x})
    assert out.path == "cuda_shm"
    back = torch.from_dlpack(out["OUTPUT0"])
    assert back.is_cuda and torch.equal(back, x)


@pytest.mark.gpu
def test_split_batch_concatenates_on_gpu(
    cupy: Any, make_client: Callable[..., TritonShmClient], triton_server: TritonServer
) -> None:
    client = make_client(pools=_cuda_pools())
    x = cupy.random.random((7, 100), dtype=cupy.float32)  # slots hold 2 rows: 4 chunks
    out = client.infer("affine", {"INPUT0": x})
    assert isinstance(out["OUTPUT0"], cupy.ndarray)
    cupy.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)


@pytest.mark.gpu
def test_views_pin_the_slot_until_dropped(cupy: Any, cuda_client: TritonShmClient) -> None:
    x = cupy.ones((1, 64), dtype=cupy.float32)
    with cuda_client.infer_views("affine", {"INPUT0": x}) as views:
        kept = views["OUTPUT0"][0, :8]
        assert isinstance(kept, cupy.ndarray)
    del views
    stats = cuda_client.pool("affine").stats()
    assert stats.pinned == 1  # the view is alive: its slot is not reused
    cupy.testing.assert_array_equal(kept, cupy.full(8, -1, dtype=cupy.float32))
    del kept
    pool = cuda_client.pool("affine")
    leases = [pool.try_acquire(), pool.try_acquire()]  # both slots lendable again
    assert all(lease is not None for lease in leases)
    for lease in leases:
        lease.release()


@pytest.mark.gpu
def test_lease_filled_in_place_on_gpu(cupy: Any, cuda_client: TritonShmClient) -> None:
    with cuda_client.lease("identity") as lease:
        lease.input("INPUT0", (2, 10))[:] = cupy.arange(20, dtype=cupy.float32).reshape(2, 10)
        views = cuda_client.run(lease)
        cupy.testing.assert_array_equal(views["OUTPUT0"], cupy.arange(20, dtype=cupy.float32).reshape(2, 10))
        del views


@pytest.mark.gpu
def test_unregister_before_free(
    cupy: Any,
    make_client: Callable[..., TritonShmClient],
    triton_server: TritonServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray_triton_shm._private.shm import cuda as cuda_module

    client = make_client(pools=_cuda_pools())
    client.infer("identity", {"INPUT0": cupy.zeros((1, 8), cupy.float32)})
    name = client.pool("identity").region_name
    assert name in _regions(triton_server.grpc_url)[0]
    events: list[str] = []
    real_unregister = client._grpc.unregister_cuda_shared_memory
    real_close = cuda_module.DeviceBuffer.close

    def unregister(region: str, *args: Any, **kwargs: Any) -> Any:
        events.append(f"unregister {region}")
        return real_unregister(region, *args, **kwargs)

    def close(self: Any) -> None:
        events.append(f"free {self.size}")
        real_close(self)

    monkeypatch.setattr(client._grpc, "unregister_cuda_shared_memory", unregister)
    monkeypatch.setattr(cuda_module.DeviceBuffer, "close", close)
    buffer = client.pool("identity").buffer
    client.close()
    assert events[:2] == [f"unregister {name}", f"free {buffer.size}"]
    assert buffer.ptr == 0
    assert name not in _regions(triton_server.grpc_url)[0]


@pytest.mark.gpu
def test_invalid_ipc_handle_is_a_cuda_error(cupy: Any) -> None:
    from ray_triton_shm._private.shm.cuda import DeviceBuffer

    with pytest.raises(CudaError, match="invalid CUDA IPC handle"):
        DeviceBuffer.open(b"\x01" * 64, 4096, 0)


@pytest.mark.gpu
def test_triton_refusing_a_region_is_a_cuda_error(
    cupy: Any,
    make_client: Callable[..., TritonShmClient],
    triton_server: TritonServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handle Triton cannot open (garbage bytes) is refused: a CudaError, nothing kept, nothing leaked.

    (A wrong *device id* is no way to provoke a refusal: Triton ignores the
    result of ``cudaSetDevice`` and opens the handle anyway, see docs/cuda.md.)
    """
    from ray_triton_shm._private.shm import cuda as cuda_module

    monkeypatch.setattr(cuda_module.DeviceBuffer, "handle_b64", property(lambda self: b"A" * 88))
    client = make_client(pools=_cuda_pools(device_id=0))
    before = _regions(triton_server.grpc_url)
    with pytest.raises(CudaError, match="Triton refused CUDA region"):
        client.infer("identity", {"INPUT0": cupy.zeros((1, 8), cupy.float32)})
    assert _regions(triton_server.grpc_url) == before
    assert client.pool_stats() == []


@pytest.mark.gpu
def test_the_registered_device_is_our_mapping(
    cupy: Any, make_client: Callable[..., TritonShmClient], triton_server: TritonServer
) -> None:
    """Triton registers whatever device id it is told (it does not check it): ours must be right.

    The id in Triton's status is the one ``server_device_id`` computed from the
    server process's own CUDA_VISIBLE_DEVICES (read from /proc, not assumed).
    """
    from ray_triton_shm._private.shm.cuda_devices import detect_server_visible, server_device_id

    client = make_client(pools=_cuda_pools(device_id=0))
    client.infer("identity", {"INPUT0": cupy.zeros((1, 8), cupy.float32)})
    name = client.pool("identity").region_name
    with grpcclient.InferenceServerClient(triton_server.grpc_url) as grpc:
        status = grpc.get_cuda_shared_memory_status(name, as_json=True)["regions"][name]
    server_visible = detect_server_visible(triton_server.grpc_url)
    assert server_visible == os.environ.get("CUDA_VISIBLE_DEVICES")  # the fixture's server inherited ours
    expected = server_device_id(0, os.environ.get("CUDA_VISIBLE_DEVICES"), server_visible)
    assert int(status.get("device_id", 0)) == expected


@pytest.mark.gpu
def test_server_that_cannot_see_the_gpu_is_refused_before_registering(
    cupy: Any, make_client: Callable[..., TritonShmClient], triton_server: TritonServer
) -> None:
    client = make_client(pools=_cuda_pools(), server_visible_devices="")  # a server that sees no GPU
    before = _regions(triton_server.grpc_url)
    with pytest.raises(DeviceMappingError, match="not visible to the server"):
        client.infer("identity", {"INPUT0": cupy.zeros((1, 8), cupy.float32)})
    assert _regions(triton_server.grpc_url) == before


_RENUMBERED_CLIENT = """
import sys, cupy
from ray_triton_shm import PoolConfig, TritonShmClient
url, expected_server_id = sys.argv[1], int(sys.argv[2])
shape = {"INPUT0": (64,), "OUTPUT0": (64,)}
pools = {"identity": PoolConfig(slots=1, max_batch_size=1, max_shapes=shape, memory="cuda", device_id=0)}
with TritonShmClient(url=url, pools=pools, server_visible_devices="all") as client:
    x = cupy.arange(64, dtype=cupy.float32).reshape(1, 64)
    out = client.infer("identity", {"INPUT0": x})
    assert out.path == "cuda_shm", out.path
    assert bool((out["OUTPUT0"] == x).all()), "wrong data"
    from ray_triton_shm._private.shm.cuda_devices import server_device_id
    import os
    got = server_device_id(0, os.environ["CUDA_VISIBLE_DEVICES"], None)
    assert got == expected_server_id, (got, expected_server_id)
print("OK")
"""


@pytest.mark.gpu
def test_device_id_under_renumbering(cupy: Any) -> None:
    """A client seeing only the last GPU (as its device 0, as under Ray) reaches it on a Triton seeing all.

    With one GPU the ids coincide (0 -> 0); the unit tests cover the mapping itself.
    """
    count = cupy.cuda.runtime.getDeviceCount()
    last = count - 1
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    server_env_backup = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        server = TritonServer(ServerConfig(model_repository=str(MODEL_REPOSITORY), load_models=("identity",)))
        with server:
            env["CUDA_VISIBLE_DEVICES"] = str(last)
            env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            done = subprocess.run(
                [sys.executable, "-c", _RENUMBERED_CLIENT, server.grpc_url, str(last)],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
            assert _regions(server.grpc_url)[0] == []
    finally:
        if server_env_backup is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = server_env_backup


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_cuda_small(cupy: Any, triton_server: TritonServer) -> None:
    from ray_triton_shm._private.bench.cuda_paths import run_bench

    rows = run_bench(triton_server.grpc_url, 4, repeats=3, budget_s=20)
    assert [r["path"] for r in rows] == ["cuda_shm", "shm", "grpc"]
    assert all(r["matched"] and r["gb_per_s"] > 0 for r in rows)
