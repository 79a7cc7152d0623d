"""Slot references: validation, pickling, and the slot-table check that a ref's lease still holds its slot.

Real segments and slot tables, no server: the run itself is tested on real
Ray and Triton in tests/integration/on_ray/test_slot_refs.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest

from ray_triton_shm._private.serve.slot_ref import SlotRef, check_ref, make_ref
from ray_triton_shm._private.shm.layout import layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import LEASED, SlotTable, lease_token, token_pid
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import (
    InputError,
    SlotRefElsewhereError,
    SlotRefError,
    StaleSlotRefError,
)

CONFIG = {
    "name": "m",
    "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": ["-1"]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": ["-1"]}],
}


def _ref(**changes) -> SlotRef:
    fields = {
        "node_id": "n1",
        "model": "m",
        "region": "rtshm_pool_x",
        "fingerprint": "f",
        "slot": 1,
        "pid": 1234,
        "token": lease_token(1234, 77),
        "input_shapes": (("IN", (4,)),),
    }
    fields.update(changes)
    return SlotRef(**fields)


def test_pickles_small_and_equal() -> None:
    ref = _ref(outputs=("OUT",))
    data = pickle.dumps(ref)
    assert pickle.loads(data) == ref and len(data) < 400
    assert ref.shapes == {"IN": (4,)}


@pytest.mark.parametrize(
    "changes",
    [
        {"node_id": ""},
        {"model": None},
        {"slot": -1},
        {"slot": True},
        {"pid": 0},
        {"token": LEASED},
        {"token": 5},
        {"token": lease_token(999, 77)},  # another pid's token
        {"input_shapes": ()},
        {"input_shapes": (("IN", (4,)), ("IN", (4,)))},
        {"input_shapes": (("IN", (-1,)),)},
        {"input_shapes": (("IN", [4]),)},
        {"outputs": ["OUT"]},
        {"fingerprint": None},
    ],
)
def test_invalid_fields_are_refused(changes) -> None:
    with pytest.raises(SlotRefError):
        _ref(**changes)


def test_token_round_trip() -> None:
    token = lease_token(os.getpid(), 12345)
    assert token < LEASED and token_pid(token) == os.getpid() & 0x3FFFFF


@pytest.fixture
def shared():
    """A pool shared through a slot table (as a node actor's), plus a second process-like view of it."""
    layout = layout_from_config(CONFIG, PoolConfig(max_shapes={"IN": (16,), "OUT": (16,)}))
    data = Segment.create(new_segment_name("refstest"), 2 * layout.slot_bytes)
    owner = SlotTable.create(new_segment_name("refstest"), slots=2, quarantine_s=0.2)
    caller = SlotPool(Segment.attach(data.name), layout, range(2))
    caller.share(SlotTable.attach(owner.name))
    replica = SlotPool(Segment.attach(data.name), layout, range(2))
    replica.share(SlotTable.attach(owner.name))
    yield caller, replica
    caller.close()
    replica.close()
    owner.close()
    data.close()
    for name in (data.name, owner.name):
        assert not os.path.exists(f"/dev/shm/{name}")


def test_a_held_slot_checks_and_a_released_one_is_stale(shared) -> None:
    caller, replica = shared
    lease = caller.acquire(1.0)
    lease.input("IN", (4,))[:] = 1.0
    ref = make_ref(lease, "n1")
    assert ref is not None and ref.pid == os.getpid() and ref.slot == lease.slot.index
    assert check_ref(replica, ref, "n1") == {"IN": (4,)}
    lease.release()
    with pytest.raises(StaleSlotRefError):
        check_ref(replica, ref, "n1")
    # The same slot leased again (a new token): the old ref stays stale.
    both = [caller.acquire(1.0), caller.acquire(1.0)]
    assert ref.slot in {held.slot.index for held in both}
    with pytest.raises(StaleSlotRefError):
        check_ref(replica, ref, "n1")
    for held in both:
        held.release()


def test_a_ref_naming_another_holder_is_stale(shared) -> None:
    caller, replica = shared
    with caller.acquire(1.0) as lease:
        lease.input("IN", (4,))[:] = 1.0
        ref = make_ref(lease, "n1")
        assert ref is not None
        forged = _ref(
            region=ref.region,
            fingerprint=ref.fingerprint,
            slot=ref.slot,
            pid=4242,
            token=lease_token(4242, 9),
        )
        with pytest.raises(StaleSlotRefError):
            check_ref(replica, forged, "n1")
        other = 1 - ref.slot  # a slot nobody holds
        with pytest.raises(StaleSlotRefError):
            check_ref(replica, _ref(region=ref.region, fingerprint=ref.fingerprint, slot=other), "n1")


def test_a_slot_leased_by_another_process_checks_only_with_its_token(shared) -> None:
    caller, replica = shared
    table = caller._table
    code = (
        "from ray_triton_shm._private.shm.slot_table import SlotTable\n"
        f"t = SlotTable.attach({table.name!r}); assert t.try_claim(0); print(t.token(0), flush=True)\n"
        "import sys; sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        token = int(child.stdout.readline())
        assert token_pid(token) == child.pid & 0x3FFFFF
        ref = _ref(
            region=caller.region_name,
            fingerprint=caller.layout.fingerprint,
            slot=0,
            pid=child.pid,
            token=token,
        )
        assert check_ref(replica, ref, "n1") == {"IN": (4,)}
        with pytest.raises(StaleSlotRefError):
            check_ref(replica, dataclasses.replace(ref, token=lease_token(child.pid, 1)), "n1")
    finally:
        child.communicate("\n", timeout=30)
    # The child is gone: its lock with it, so its ref is stale even though its token stays written.
    with pytest.raises(StaleSlotRefError):
        check_ref(replica, ref, "n1")


def test_other_node_pool_or_shapes_are_refused(shared) -> None:
    caller, replica = shared
    with caller.acquire(1.0) as lease:
        lease.input("IN", (4,))[:] = 1.0
        ref = make_ref(lease, "n1")
        assert ref is not None
        with pytest.raises(SlotRefElsewhereError):
            check_ref(replica, ref, "n2")
        with pytest.raises(SlotRefElsewhereError):
            check_ref(replica, dataclasses.replace(ref, region="rtshm_pool_other"), "n1")
        with pytest.raises(SlotRefElsewhereError):
            check_ref(replica, dataclasses.replace(ref, fingerprint="old"), "n1")
        with pytest.raises(InputError):
            check_ref(replica, dataclasses.replace(ref, input_shapes=(("IN", (17,)),)), "n1")
        with pytest.raises(InputError):
            check_ref(replica, dataclasses.replace(ref, input_shapes=(("NOPE", (4,)),)), "n1")
        with pytest.raises(InputError):
            check_ref(replica, dataclasses.replace(ref, outputs=("NOPE",)), "n1")


def test_an_unshared_pool_has_no_ref(make_pool) -> None:
    layout = layout_from_config(CONFIG, PoolConfig(max_shapes={"IN": (16,), "OUT": (16,)}))
    pool = make_pool(layout, 1)
    with pool.acquire(1.0) as lease:
        lease.input("IN", (4,))
        assert make_ref(lease, "n1") is None


def test_a_ref_needs_every_input_placed(shared) -> None:
    caller, _ = shared
    with caller.acquire(1.0) as lease, pytest.raises(InputError):
        make_ref(lease, "n1")
