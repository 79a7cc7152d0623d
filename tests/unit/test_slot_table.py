"""Slots shared by processes through a slot table: real segments, real processes, no server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ray_triton_shm._private.shm.layout import layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import PoolClosedError, PoolTimeoutError, SharedMemoryError
from tests.helpers import wait_for

CONFIG = {
    "name": "m",
    "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": ["4"]}],
}


@pytest.fixture
def table():
    owner = SlotTable.create(new_segment_name("slotstest"), slots=3, quarantine_s=0.4)
    yield owner
    owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def _in_child(table_name: str, body: str) -> str:
    code = (
        "import os, sys, time\n"
        "from ray_triton_shm._private.shm.slot_table import SlotTable\n"
        f"t = SlotTable.attach({table_name!r})\n" + body
    )
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_one_process_at_a_time(table) -> None:
    a, b = SlotTable.attach(table.name), SlotTable.attach(table.name)
    try:
        assert a.try_claim(0) and not b.try_claim(0) and b.try_claim(1)
        assert table.state() == {"in_use": 2, "protected": 0, "free": 1}
        a.release(0)
        assert b.try_claim(0)
    finally:
        a.close()
        b.close()
    assert table.state()["in_use"] == 0


def test_a_protected_slot_waits_for_its_deadline(table) -> None:
    a = SlotTable.attach(table.name)
    assert a.try_claim(2)
    a.release(2, time.monotonic_ns() + 300_000_000)
    assert not table.try_claim(2) and table.state()["protected"] == 1
    time.sleep(0.35)
    assert table.try_claim(2)
    table.release(2)
    a.close()


def test_a_slot_of_a_process_that_died_mid_lease_is_quarantined(table) -> None:
    assert _in_child(table.name, "print(t.try_claim(1)); os._exit(0)").strip() == "True"
    assert not table.try_claim(1)  # left leased: the first to see it starts the quarantine
    assert table.sweep() == 0  # already started
    time.sleep(0.45)
    assert table.try_claim(1)
    table.release(1)


def test_another_process_holds_a_slot_while_it_lives(table) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom ray_triton_shm._private.shm.slot_table import SlotTable\n"
            f"t = SlotTable.attach({table.name!r})\nprint(t.try_claim(0), flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "True"
        assert not table.try_claim(0)
        assert table.state()["in_use"] == 1
    finally:
        child.stdin.close()
        child.wait()


def test_attach_refuses_what_is_not_a_table() -> None:
    other = Segment.create(new_segment_name("slotstest"), 64)
    try:
        with pytest.raises(SharedMemoryError, match="not a slot table"):
            SlotTable.attach(other.name)
    finally:
        other.close()


def _shared_pool(slots: int, quarantine_s: float = 0.4) -> tuple[SlotPool, SlotTable, Segment]:
    layout = layout_from_config(CONFIG, PoolConfig())
    data = Segment.create(new_segment_name("slotstest"), slots * layout.slot_bytes)
    owner = SlotTable.create(new_segment_name("slotstest"), slots=slots, quarantine_s=quarantine_s)
    pool = SlotPool(Segment.attach(data.name), layout, range(slots), quarantine_s=quarantine_s)
    pool.share(SlotTable.attach(owner.name))
    return pool, owner, data


def test_pools_of_two_processes_share_slots_on_demand() -> None:
    pool, owner, data = _shared_pool(2)
    try:
        first = pool.acquire(1.0)
        # Another process takes the other slot for a moment and gives it back.
        assert _in_child(owner.name, "print(t.try_claim(1), t.try_claim(0)); t.release(1)").split() == [
            "True",
            "False",
        ]
        second = pool.acquire(1.0)
        assert {first.slot.index, second.slot.index} == {0, 1}
        with pytest.raises(PoolTimeoutError):
            pool.acquire(0.1)
        first.release()
        assert owner.state()["in_use"] == 1
        second.release()
        assert owner.state() == {"in_use": 0, "protected": 0, "free": 2}
    finally:
        pool.close()
        owner.close()
        data.close()


def test_max_in_use_caps_this_process() -> None:
    pool, owner, data = _shared_pool(3)
    try:
        pool.share(pool._table, max_in_use=1)
        lease = pool.acquire(1.0)
        with pytest.raises(PoolTimeoutError):
            pool.acquire(0.1)
        lease.release()
        pool.acquire(1.0).release()
    finally:
        pool.close()
        owner.close()
        data.close()


def test_closing_a_pool_keeps_in_doubt_and_viewed_slots_from_others() -> None:
    pool, owner, data = _shared_pool(3, quarantine_s=5.0)
    try:
        in_doubt = pool.acquire(1.0)
        in_doubt.mark_in_doubt()
        in_doubt.release()
        viewed = pool.acquire(1.0)
        view = viewed.output("OUT", (4,))
        viewed.release()
        pool.close()
        # The timed-out slot is protected; the viewed one stays locked while the view lives.
        assert owner.state() == {"in_use": 1, "protected": 1, "free": 1}
        assert not owner.try_claim(in_doubt.slot.index) and not owner.try_claim(viewed.slot.index)
        assert np.asarray(view).shape == (4,)
        del view
        assert owner.state()["in_use"] == 0
        assert not owner.try_claim(viewed.slot.index)  # left leased: quarantined by the next taker
    finally:
        owner.close()
        data.close()


def test_threads_leasing_and_pinning_shared_slots_return_each_exactly_once() -> None:
    """Leases from many threads, half of them leaving a live output view behind (the slot pinned
    until another thread drops it): no slot is ever held twice, and every one comes back once."""
    import threading

    slots, threads, rounds = 3, 8, 150
    pool, owner, data = _shared_pool(slots)
    guard = threading.Lock()
    busy: set[int] = set()
    clashes: list[int] = []
    kept: list[tuple[int, np.ndarray]] = []
    done = threading.Event()

    def lease_and_maybe_keep(worker: int) -> None:
        for i in range(rounds):
            with pool.acquire(10.0) as lease:
                index = lease.slot.index
                with guard:
                    if index in busy:
                        clashes.append(index)
                    busy.add(index)
                lease.input("IN", (4,))[...] = worker
                out = lease.output("OUT", (4,))
                keep = (worker + i) % 2 == 0
                if not keep:
                    with guard:
                        busy.discard(index)
                    del out
            if keep:
                with guard:
                    kept.append((index, out))
                del out

    def drop_views() -> None:
        while not done.is_set() or kept:
            with guard:
                if not kept:
                    entry = None
                else:
                    entry = kept.pop(0)
                    busy.discard(entry[0])  # before its last view dies: then it may be leased again
            if entry is None:
                time.sleep(0.0005)
            del entry

    dropper = threading.Thread(target=drop_views)
    workers = [threading.Thread(target=lease_and_maybe_keep, args=(w,)) for w in range(threads)]
    try:
        dropper.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=60)
        done.set()
        dropper.join(timeout=10)
        assert not clashes
        assert sorted(pool._free) == list(range(slots))  # each slot back once, none twice
        assert pool.stats().free == slots and pool.stats().pinned == 0
        assert owner.state() == {"in_use": 0, "protected": 0, "free": slots}
    finally:
        done.set()
        pool.close()
        owner.close()
        data.close()


def test_a_held_back_shared_slot_goes_back_to_the_table_when_its_quarantine_ends() -> None:
    # A request in doubt (its server may still write the slot) holds its slot back for the
    # quarantine: then the slot is free for every process, whether or not this one leases again.
    pool, owner, data = _shared_pool(2, quarantine_s=0.3)
    try:
        lease = pool.acquire(timeout=5)
        lease.mark_in_doubt()
        lease.release()
        assert owner.state()["free"] == 1
        deadline = time.monotonic() + 10
        while owner.state()["free"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.state()["free"] == 2, "the slot stayed held after its quarantine, with no lease since"
        assert pool.stats().quarantined == 0 and pool.stats().free == 2
    finally:
        pool.close()
        owner.close()
        data.close()


class _ClosesOnLookup(dict):
    """The table's held slots, closing the table at the first lookup: another thread closing it
    between a method's check and its write."""

    def __init__(self, table: SlotTable) -> None:
        super().__init__(table._held)
        self.table = table

    def __contains__(self, index: object) -> bool:
        held = super().__contains__(index)
        if self.table is not None:
            table, self.table = self.table, None
            table.close()
        return held


def test_a_request_on_a_pool_closed_meanwhile_ends_quietly_and_a_new_one_is_refused() -> None:
    # Another thread closes the pool (its node's connection was replaced) while a request runs on
    # one of its slots: the request's end has nothing left to record, and no new one may start.
    pool, owner, data = _shared_pool(2)
    try:
        lease = pool.acquire(timeout=5)
        lease.request_started(30.0)
        table = pool._table
        table._held = _ClosesOnLookup(table)
        lease.request_ended()  # the table closes between its check and its write
        pool.close()
        with pytest.raises(PoolClosedError):
            lease.request_started(30.0)
    finally:
        pool.close()
        owner.close()
        data.close()


def test_a_process_waiting_for_a_slot_is_seen_by_the_others_until_it_stops_or_dies(table) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom ray_triton_shm._private.shm.slot_table import SlotTable\n"
            f"t = SlotTable.attach({table.name!r})\nt.set_waiting(True)\nprint('waiting', flush=True)\n"
            "sys.stdin.readline()\nt.set_waiting(False)\nprint('stopped', flush=True)\n"
            "sys.stdin.readline()\nt.set_waiting(True)\nprint('waiting', flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert not table.others_waiting()
        assert child.stdout.readline().strip() == "waiting"
        assert table.others_waiting()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "stopped"
        assert not table.others_waiting()
        table.set_waiting(True)  # this process's own wait is not another's
        assert not table.others_waiting()
        table.set_waiting(False)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "waiting"
        assert table.others_waiting()
    finally:
        child.stdin.close()
        child.wait()
    assert not table.others_waiting()  # it died waiting: the kernel dropped its lock


def test_a_pool_counts_its_own_waiters_and_shows_them_to_the_other_processes() -> None:
    pool, owner, data = _shared_pool(1)
    try:
        held = pool.acquire(1.0)
        assert pool.waiting == 0
        waiter = threading.Thread(target=lambda: pool.acquire(5.0).release())
        waiter.start()
        assert wait_for(lambda: pool.waiting == 1)
        assert owner.others_waiting()  # the owner's table is another description: another process's view
        owner.set_waiting(True)  # callers of "another process" wait too
        assert pool.waiting == 2
        owner.set_waiting(False)
        held.release()
        waiter.join(5)
        assert pool.waiting == 0 and not owner.others_waiting()
    finally:
        pool.close()
        owner.close()
        data.close()
