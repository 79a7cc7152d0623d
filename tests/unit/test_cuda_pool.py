"""CUDA slot pools against a fake cupy (host memory posing as a GPU): what can be checked without one.

The fake records on which device and stream each copy, allocation and wait
ran; these tests check the pool asks for the right ones. Whether CUDA then
does the right thing is for the GPU integration tests.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import fake_cupy
import numpy as np
import pytest

from ray_triton_shm._private.shm.cuda import REGION_ALIGN, DeviceBuffer
from ray_triton_shm._private.shm.cuda_pool import CudaSlotPool
from ray_triton_shm._private.shm.layout import layout_from_config
from ray_triton_shm.config import PoolConfig

SAME_NAME_CONFIG = {
    "name": "same_name",
    "max_batch_size": 2,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
}

IDENTITY = {
    "name": "identity",
    "max_batch_size": 2,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}],
}


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Two fake GPUs; the calling thread's current device is 0."""
    state = fake_cupy.reset(devices=2)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    yield state
    fake_cupy.reset()


def _ops(state: Any, *names: str) -> list[tuple[Any, ...]]:
    return [entry for entry in state.log if entry[0] in names]


def test_regions_are_whole_2mib_blocks(gpu: Any) -> None:
    small = DeviceBuffer.allocate(1000, 1)
    big = DeviceBuffer.allocate(REGION_ALIGN + 1, 0)
    assert _ops(gpu, "malloc") == [("malloc", 1, REGION_ALIGN), ("malloc", 0, 2 * REGION_ALIGN)]
    assert (small.size, big.size) == (1000, REGION_ALIGN + 1)  # what is registered and sliced
    small.close()
    big.close()
    assert len(_ops(gpu, "free")) == 2 and not gpu.allocations


def test_output_named_like_an_input_is_read_from_the_output(gpu: Any) -> None:
    layout = layout_from_config(SAME_NAME_CONFIG, PoolConfig())
    assert layout.input("X").offset != layout.output("X").offset
    pool = CudaSlotPool.create(layout, 1, device=0)
    try:
        with pool.acquire(1.0) as lease:
            lease.write_input("X", np.ones((2, 4), np.float32))
            lease.flush()
            out_view = lease.output("X", (2, 4))
            out_view._np[...] = 7.0  # what Triton would write into the output's place
            copied = lease.copy_output("X", (2, 4))
            del out_view
        assert fake_cupy.asnumpy(copied).tolist() == [[7.0] * 4] * 2
    finally:
        pool.close()


def test_copies_run_on_the_pools_gpu_and_stream_after_the_producer(gpu: Any) -> None:
    layout = layout_from_config(IDENTITY, PoolConfig())
    pool = CudaSlotPool.create(layout, 2, device=1)  # this thread's current device stays 0
    try:
        with fake_cupy.Device(0):
            producer = fake_cupy.Stream(non_blocking=True)
            with producer:
                # Strided, on GPU 0, produced on a non-blocking stream.
                source = fake_cupy.asarray(np.arange(16, dtype=np.float32).reshape(2, 8))[:, ::2]
        gpu.log.clear()
        with pool.acquire(1.0) as lease:
            with producer:
                lease.write_input("INPUT0", source)
            ours = pool.stream.name
            assert _ops(gpu, "ascontiguous", "record", "wait_event", "memcpy") == [
                ("ascontiguous", 0, producer.name),  # on the source's GPU and stream
                ("record", producer.name, 0),
                ("wait_event", ours, producer.name, 1),
                ("memcpy", 1, ours, 32),
            ]
            gpu.log.clear()
            lease.flush()
            assert gpu.log == [("record", ours, 1), ("event_synchronize", ours)]  # no deviceSynchronize
            lease.flush()  # nothing queued since: nothing to wait for
            assert len(gpu.log) == 2
            assert fake_cupy.asnumpy(lease.input("INPUT0", (2, 4))).tolist() == (
                np.arange(16).reshape(2, 8)[:, ::2].tolist()
            )
            lease.output("OUTPUT0", (2, 4))._np[...] = 3.0
            result = lease.copy_output("OUTPUT0", (2, 4))
            assert _ops(gpu, "copy") == [("copy", 1, "null", 1)]  # with the pool's GPU current
            assert fake_cupy.asnumpy(result).tolist() == [[3.0] * 4] * 2
            lease.write_input("INPUT0", np.zeros((1, 4), np.float32))
            assert _ops(gpu, "set") == [("set", 1, ours)]
        # Releasing with copies still queued waits for them: the slot must not change hands mid-copy.
        assert _ops(gpu, "event_synchronize")[-1] == ("event_synchronize", ours)
        assert not _ops(gpu, "deviceSynchronize")
    finally:
        pool.close()


def test_flush_waits_for_the_callers_stream_after_in_place_fills(gpu: Any) -> None:
    pool = CudaSlotPool.create(layout_from_config(IDENTITY, PoolConfig()), 1, device=1)
    try:
        with pool.acquire(1.0) as lease:
            lease.flush()
            assert not _ops(gpu, "record", "event_synchronize")  # nothing written: nothing to wait for
            with fake_cupy.Device(1), fake_cupy.Stream(non_blocking=True) as mine:
                lease.input("INPUT0", (1, 4))._np[...] = 1.0  # a kernel of the caller's, on its stream
                lease.flush()
            assert _ops(gpu, "record", "event_synchronize") == [
                ("record", mine.name, 1),
                ("event_synchronize", mine.name),
            ]
            assert not _ops(gpu, "deviceSynchronize")
    finally:
        pool.close()


def test_closing_while_views_live_frees_when_the_last_dies(gpu: Any) -> None:
    layout = layout_from_config(IDENTITY, PoolConfig())
    pool = CudaSlotPool.create(layout, 2, device=0)
    with pool.acquire(1.0) as lease:
        view = lease.output("OUTPUT0", (1, 4))
        part = view[0]
    with pool.acquire(1.0) as other:
        other.input("INPUT0", (1, 4))
    pool.close()
    assert not _ops(gpu, "free")  # a live view still points into the region
    del view
    gc.collect()
    assert not _ops(gpu, "free")  # a view of a view too
    del part
    gc.collect()
    assert len(_ops(gpu, "free")) == 1 and not gpu.allocations


def test_closing_without_views_frees_at_once(gpu: Any) -> None:
    pool = CudaSlotPool.create(layout_from_config(IDENTITY, PoolConfig()), 1, device=0)
    with pool.acquire(1.0) as lease:
        lease.write_input("INPUT0", np.ones((1, 4), np.float32))
    pool.close()
    assert len(_ops(gpu, "free")) == 1 and not gpu.allocations


class _OnePool:
    """A PoolSource that hands out one ready-made pool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def get_pool(self, model: str, config: PoolConfig) -> Any:
        return self.pool

    def close(self) -> None:
        self.pool.close()


def _route(client: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which way ``infer`` sends a request instead of sending it."""
    from ray_triton_shm.client import InferResult

    taken: list[str] = []
    monkeypatch.setattr(client, "_call_grpc", lambda *a, **k: taken.append("grpc") or {})
    monkeypatch.setattr(
        client, "_infer_shm", lambda *a, **k: taken.append("shm") or InferResult({}, "cuda_shm")
    )
    return taken


@pytest.mark.parametrize("min_shm_bytes", [None, 1 << 20])
def test_small_requests_to_a_cuda_pool_never_go_over_host_grpc(
    gpu: Any, monkeypatch: pytest.MonkeyPatch, min_shm_bytes: int | None
) -> None:
    from ray_triton_shm.client import TritonShmClient

    monkeypatch.delenv("RAY_TRITON_SHM_MIN_SHM_BYTES", raising=False)  # the test session sets 0
    pool = CudaSlotPool.create(layout_from_config(IDENTITY, PoolConfig()), 1, device=0)
    config = PoolConfig(memory="cuda", min_shm_bytes=min_shm_bytes)
    # No http_url: gRPC transport, whose default threshold for system memory is 64 KiB.
    with TritonShmClient(url="127.0.0.1:1", default_pool=config, pool_source=_OnePool(pool)) as client:
        taken = _route(client, monkeypatch)
        client.infer("identity", {"INPUT0": np.ones((1, 4), np.float32)})  # 16 bytes
        client.infer("identity", {"INPUT0": fake_cupy.asarray(np.ones((1, 4), np.float32))})
        assert taken == ["shm", "shm"]


def test_small_device_inputs_to_a_system_pool_go_through_shm(
    gpu: Any, monkeypatch: pytest.MonkeyPatch, make_pool: Any
) -> None:
    from ray_triton_shm.client import TritonShmClient

    pool = make_pool(layout_from_config(IDENTITY, PoolConfig()), 1)
    config = PoolConfig(min_shm_bytes=1 << 20)
    with TritonShmClient(url="127.0.0.1:1", default_pool=config, pool_source=_OnePool(pool)) as client:
        taken = _route(client, monkeypatch)
        client.infer("identity", {"INPUT0": np.ones((1, 4), np.float32)})
        client.infer("identity", {"INPUT0": fake_cupy.asarray(np.ones((1, 4), np.float32))})
        assert taken == ["grpc", "shm"]  # host inputs keep the measured crossover


def test_shm_threshold_is_zero_for_gpu_memory() -> None:
    assert PoolConfig(min_shm_bytes=1000).shm_threshold(over_http=False, cuda=True) == 0
    assert PoolConfig(min_shm_bytes=None).shm_threshold(over_http=False, cuda=True) == 0
    assert PoolConfig(min_shm_bytes=1000).shm_threshold(over_http=False) == 1000


class _FakeTriton:
    """tritonclient's CUDA shm calls, scripted: the region stays listed for ``held`` status polls."""

    def __init__(self, held: int, status_error: str = "NOT_FOUND") -> None:
        self.held = held
        self.status_error = status_error
        self.calls: list[str] = []

    def unregister_cuda_shared_memory(self, name: str, headers: Any = None) -> None:
        self.calls.append("unregister")

    def get_cuda_shared_memory_status(self, name: str, headers: Any = None, as_json: bool = False) -> Any:
        from tritonclient.utils import InferenceServerException

        self.calls.append("status")
        if self.held > 0:
            self.held -= 1
            return {"regions": {name: {"name": name, "device_id": 0, "byte_size": "1"}}}
        raise InferenceServerException(
            f"Unable to find cuda shared memory region: '{name}'", status=f"StatusCode.{self.status_error}"
        )


def _local_pools(triton: _FakeTriton) -> tuple[Any, CudaSlotPool]:
    from ray_triton_shm._private.core.local_pools import LocalPools

    pools = LocalPools(triton)  # type: ignore[arg-type]
    pool = CudaSlotPool.create(layout_from_config(IDENTITY, PoolConfig()), 1, device=0)
    pools._pools.append(pool)
    return pools, pool


@pytest.mark.parametrize("status_error", ["NOT_FOUND", "INVALID_ARGUMENT", "UNAVAILABLE"])
def test_close_frees_a_cuda_region_only_once_triton_let_go(gpu: Any, status_error: str) -> None:
    triton = _FakeTriton(held=3, status_error=status_error)  # closed "later", as Triton >= r24.11 does
    pools, _pool = _local_pools(triton)
    pools.close()
    assert triton.calls == ["unregister", "status", "status", "status", "status"]
    assert len(_ops(gpu, "free")) == 1 and not gpu.allocations


def test_close_leaks_a_cuda_region_triton_keeps(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_triton_shm._private.shm import cuda_pool

    monkeypatch.setattr("ray_triton_shm._private.core.local_pools._UNREGISTER_WAIT_S", 0.3)
    monkeypatch.setattr(cuda_pool, "LEAKED", [])
    triton = _FakeTriton(held=10**6)
    pools, pool = _local_pools(triton)
    pools.close()
    assert triton.calls[0] == "unregister" and triton.calls.count("status") >= 2
    assert not _ops(gpu, "free") and len(gpu.allocations) == 1  # leaked, not freed
    assert cuda_pool.LEAKED == [pool.buffer] and pool.buffer.ptr
    with pytest.raises(Exception, match="closed"):
        pool.acquire(0.1)
    pool.abandon()
    assert cuda_pool.LEAKED == [pool.buffer]
