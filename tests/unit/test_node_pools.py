"""A node's pools when a model's config changes: real segments and slot tables, no server."""

from __future__ import annotations

import os
import time

import pytest

from ray_triton_shm._private.node.node_pools import NodePools
from ray_triton_shm._private.shm.layout import layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import LayoutMismatchError


def _config(dims: int) -> dict:
    return {
        "name": "m",
        "max_batch_size": 0,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [str(dims)]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [str(dims)]}],
    }


POOL = PoolConfig(slots=2)


@pytest.fixture
def pools():
    registered: list[str] = []
    pools = NodePools(
        lambda region: registered.append(region.name),
        lambda region: registered.remove(region.name),
        quarantine_s=0.2,
    )
    yield pools, registered
    pools.close()
    assert registered == []


def _attach(pools: NodePools, model: str = "m") -> SlotPool:
    """What a client process does with a grant."""
    grant = pools.grant(model)
    segment = Segment.attach(grant.segment_name, grant.segment_size)
    pool = SlotPool(segment, grant.layout, grant.slots, quarantine_s=pools.quarantine_s)
    pool.share(SlotTable.attach(grant.table_name))
    return pool


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_a_new_layout_retires_the_old_pool_once_its_slots_are_let_go(pools) -> None:
    pools, registered = pools
    old_layout = layout_from_config(_config(4), POOL)
    pools.ensure_pool("m", old_layout, POOL)
    user = _attach(pools)
    old = [user.region_name, user._table.name]
    assert not user.retired
    lease = user.acquire(1.0)

    new_layout = layout_from_config(_config(8), POOL)
    assert new_layout.fingerprint != old_layout.fingerprint
    pools.ensure_pool("m", new_layout, POOL)  # the config changed: a new pool, the old one retired
    grant = pools.grant("m")
    assert grant.layout == new_layout and grant.segment_name != old[0]
    assert registered == [old[0], grant.segment_name]
    assert user.retired and pools.retired_count() == 1
    with pytest.raises(LayoutMismatchError) as info:
        user.acquire(1.0)  # no more slots of a retired pool
    assert info.value.layout_fingerprint == old_layout.fingerprint and "retired" in str(info.value)

    assert pools.reap() == 0 and all(_exists(n) for n in old)  # a slot is still held
    lease.release()
    assert pools.reap() == 1 and pools.retired_count() == 0
    assert not any(_exists(n) for n in old) and registered == [grant.segment_name]
    user.close()

    fresh = _attach(pools)
    with fresh.acquire(1.0) as lease:
        assert lease.input("IN", (8,)).shape == (8,)
    fresh.close()


def test_the_same_layout_keeps_the_pool(pools) -> None:
    pools, registered = pools
    layout = layout_from_config(_config(4), POOL)
    pools.ensure_pool("m", layout, POOL)
    first = pools.grant("m").segment_name
    pools.ensure_pool("m", layout_from_config(_config(4), POOL), POOL)
    assert pools.grant("m").segment_name == first and pools.retire("m", layout) == 0
    assert registered == [first]


def test_retiring_every_pool_of_a_model_and_a_protected_slot(pools) -> None:
    pools, registered = pools
    pools.ensure_pool("m", layout_from_config(_config(4), POOL), POOL)
    user = _attach(pools)
    lease = user.acquire(1.0)
    lease.mark_in_doubt()  # a timed-out request: the slot stays protected for the quarantine
    lease.release()
    user.close()
    name = pools.grant("m").segment_name
    assert pools.retire("m") == 1 and registered == [name]
    with pytest.raises(KeyError):
        pools.grant("m")
    assert pools.sweep() == 0 and pools.retired_count() == 1 and _exists(name)  # still protected
    time.sleep(0.25)
    pools.sweep()  # the node's watcher: reaps idle retired pools
    assert pools.retired_count() == 0 and not _exists(name) and registered == []


def test_the_slot_table_says_retired() -> None:
    from ray_triton_shm._private.shm.segment import new_segment_name

    owner = SlotTable.create(new_segment_name("slotstest"), slots=1, quarantine_s=0.1)
    user = SlotTable.attach(owner.name)
    assert not user.retired
    owner.retire()
    late = SlotTable.attach(owner.name)  # a grant taken just before the retirement still attaches
    assert user.retired and late.retired
    late.close()
    user.close()
    owner.close()
    assert not _exists(owner.name)
