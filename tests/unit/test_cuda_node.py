"""The node side of CUDA pools that runs without a GPU: pool choice, grants of GPU regions, config."""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass, field

import pytest

from ray_triton_shm._private.layout import layout_from_config
from ray_triton_shm._private.node_pools import CudaRegion, NodePools, pool_key
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.errors import ConfigError, CudaUnavailableError

node = pytest.importorskip("ray_triton_shm.node")

CONFIG = {
    "name": "add_sub",
    "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": ["16"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": ["16"]}],
}


@dataclass
class _HostBuffer:
    """Stands in for a DeviceBuffer (no GPU here): what NodePools reads of it, and a record of close()."""

    size: int
    device: int
    handle: bytes = b"\x07" * 64
    events: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.events.append("free")


def test_runs_on_gpu() -> None:
    assert node.runs_on_gpu({"instance_group": [{"kind": "KIND_GPU", "count": 1}]})
    assert node.runs_on_gpu({"instance_group": [{"kind": "KIND_CPU"}, {"kind": "KIND_GPU"}]})
    assert not node.runs_on_gpu({"instance_group": [{"kind": "KIND_CPU", "count": 2}]})
    assert not node.runs_on_gpu({})


def test_pool_key() -> None:
    assert pool_key("m") == "m"
    assert pool_key("m", "cuda", 3) == "m@cuda:3"


def test_cuda_region_grant_and_unregister_before_free() -> None:
    events: list[str] = []
    registered: list[str] = []
    pools = NodePools(
        lambda region: registered.append(region.name),
        lambda region: events.append(f"unregister {region.name}"),
        quarantine_s=0.0,
    )
    layout = layout_from_config(CONFIG, PoolConfig())
    buffer = _HostBuffer(size=0, device=1, events=events)

    def make_region(size: int) -> CudaRegion:
        buffer.size = size
        return CudaRegion(buffer, "rtshm-ncuda-test", 5)

    key = pool_key("add_sub", "cuda", 5)
    pools.ensure_pool("add_sub", layout, PoolConfig(slots=3), key=key, make_region=make_region)
    grant = pools.acquire("add_sub", 2, os.getpid(), 1.0, key=key)
    assert (grant.memory, grant.device_id, grant.cuda_handle) == ("cuda", 5, b"\x07" * 64)
    assert grant.segment_name == "rtshm-ncuda-test" and grant.segment_size == 3 * layout.slot_bytes
    assert grant.slots == (0, 1)
    assert pickle.loads(pickle.dumps(grant)) == grant
    assert registered == ["rtshm-ncuda-test"]
    # A system pool of the same model lives beside it under its own key.
    pools.ensure_pool("add_sub", layout, PoolConfig(slots=1))
    plain = pools.acquire("add_sub", 1, os.getpid(), 1.0)
    assert (plain.memory, plain.device_id, plain.cuda_handle) == ("system", -1, b"")
    assert set(pools.stats()) == {"add_sub", key}
    pools.close()
    cuda_events = [e for e in events if e in ("unregister rtshm-ncuda-test", "free")]
    assert cuda_events == ["unregister rtshm-ncuda-test", "free"]
    assert len(events) == 3  # the system segment was unregistered too


def test_failed_registration_frees_the_region() -> None:
    events: list[str] = []

    def refuse(region: object) -> None:
        raise RuntimeError("refused")

    pools = NodePools(refuse, lambda region: None, quarantine_s=0.0)
    layout = layout_from_config(CONFIG, PoolConfig())
    buffer = _HostBuffer(size=0, device=0, events=events)
    with pytest.raises(RuntimeError, match="refused"):
        pools.ensure_pool(
            "add_sub", layout, PoolConfig(), key="k", make_region=lambda size: CudaRegion(buffer, "r", 0)
        )
    assert events == ["free"]
    assert pools.stats() == {}


def test_node_config_cuda_pools_validated() -> None:
    server = ServerConfig(model_repository="/models")
    assert node.NodeConfig(server=server).cuda_pools == "auto"
    assert node.NodeConfig(server=server, cuda_pools="never").cuda_pools == "never"
    with pytest.raises(ConfigError, match="cuda_pools"):
        node.NodeConfig(server=server, cuda_pools="sometimes")


def test_node_info_pickles_with_gpu_fields() -> None:
    info = node.NodeInfo("n", "i", 1, "a:1", "a:2", "http://a:3/metrics", 42, "2.51.0", 0, 2, "2,3")
    assert pickle.loads(pickle.dumps(info)) == info
    old_style = node.NodeInfo("n", "i", 1, "a:1", "a:2", "http://a:3/metrics", 42, "2.51.0", 0)
    assert (old_style.gpus, old_style.gpu_visible_devices) == (0, None)


def test_node_client_memory_checked_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both fail before any Ray call: no cluster is needed to see them.
    with pytest.raises(ConfigError, match="memory"):
        node.NodeClient(memory="gpu")
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(CudaUnavailableError):
        node.NodeClient(memory="cuda")


def test_gpu_region_of_a_dead_client_is_freed_only_after_its_quarantine() -> None:
    import subprocess
    import time

    freed_at: list[float] = []

    class _Timed(_HostBuffer):
        def close(self) -> None:
            freed_at.append(time.monotonic())

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pools = NodePools(lambda region: None, lambda region: None, quarantine_s=0.3)
    layout = layout_from_config(CONFIG, PoolConfig())
    buffer = _Timed(size=0, device=0)

    def make_region(size: int) -> CudaRegion:
        buffer.size = size
        return CudaRegion(buffer, "r", 0)

    pools.ensure_pool("add_sub", layout, PoolConfig(slots=1), key="k", make_region=make_region)
    try:
        pools.acquire("add_sub", 1, owner.pid, 1.0, key="k")
    finally:
        owner.kill()
        owner.wait()
    before = time.monotonic()  # the quarantine begins after this, in reclaim()
    assert pools.reclaim() == 1  # the owner is gone: its slot is quarantined
    pools.close()
    assert freed_at and freed_at[0] >= before + 0.3
