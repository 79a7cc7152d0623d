"""The node side of CUDA pools that runs without a GPU: pool choice, grants of GPU regions, config."""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass, field

import pytest

from ray_triton_shm._private.node.node_pools import CudaRegion, NodePools, pool_key
from ray_triton_shm._private.shm.layout import layout_from_config
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
    grant = pools.grant("add_sub", key=key)
    assert (grant.memory, grant.device_id, grant.cuda_handle) == ("cuda", 5, b"\x07" * 64)
    assert grant.segment_name == "rtshm-ncuda-test" and grant.segment_size == 3 * layout.slot_bytes
    assert grant.slots == (0, 1, 2) and grant.table_name.startswith("rtshm_")
    assert pickle.loads(pickle.dumps(grant)) == grant
    assert registered == ["rtshm-ncuda-test"]
    # A system pool of the same model lives beside it under its own key.
    pools.ensure_pool("add_sub", layout, PoolConfig(slots=1))
    plain = pools.grant("add_sub")
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


def test_slots_of_a_dead_client_are_quarantined_by_the_sweep() -> None:
    import subprocess

    pools = NodePools(lambda region: None, lambda region: None, quarantine_s=30.0)
    layout = layout_from_config(CONFIG, PoolConfig())
    pools.ensure_pool("add_sub", layout, PoolConfig(slots=2))
    table = pools.grant("add_sub").table_name
    # A client process takes slot 0 and dies mid-lease.
    code = (
        "import os\nfrom ray_triton_shm._private.shm.slot_table import SlotTable\n"
        f"assert SlotTable.attach({table!r}).try_claim(0)\nos._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert pools.stats()["add_sub"]["quarantined"] == 1  # left leased: counted as held back
    assert pools.sweep() == 1 and pools.sweep() == 0  # its quarantine starts once
    assert pools.stats()["add_sub"] == {
        "slots": 2,
        "free": 1,
        "in_use": 0,
        "quarantined": 1,
        "slot_bytes": layout.slot_bytes,
    }
    pools.close()
    assert not os.path.exists(f"/dev/shm/{table}")


@pytest.mark.parametrize("force_cuda", [False, True])
def test_auto_memory_falls_back_to_system_when_triton_cannot_see_the_gpu(
    monkeypatch: pytest.MonkeyPatch, force_cuda: bool
) -> None:
    import types

    import fake_cupy

    from ray_triton_shm._private.node.granted_pools import GrantedPools
    from ray_triton_shm.errors import DeviceMappingError

    fake_cupy.reset(devices=1)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    # Triton was started with ServerConfig.gpus=(0,): it cannot see this process's GPU 3.
    info = types.SimpleNamespace(gpu_visible_devices="0")
    pools = GrantedPools(None, 1, info, force_cuda=force_cuda)  # type: ignore[arg-type]
    cuda_config = PoolConfig(memory="cuda")
    if force_cuda:  # memory="cuda": the caller insisted, so it is an error
        with pytest.raises(DeviceMappingError, match="not visible to the server"):
            pools._server_device(cuda_config)
    else:  # memory="auto": a system pool, as for a model that runs on CPU
        assert pools._server_device(cuda_config) is None
    info.gpu_visible_devices = "1,3"
    assert pools._server_device(cuda_config) == (0, 1)
    assert pools._server_device(PoolConfig(memory="system")) is None
