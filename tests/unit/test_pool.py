from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from ray_triton_shm._private.shm import segment
from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm.errors import InputError, LeaseReleasedError, PoolClosedError, PoolTimeoutError

MakePool = Callable[..., SlotPool]


def shm_path(name: str) -> str:
    return os.path.join(segment.SHM_DIR, name)


def wait_for_waiters(pool: SlotPool, count: int, timeout: float = 20.0) -> None:
    """Poll until ``count`` callers are queued in ``pool.acquire`` (observable state, not a sleep)."""
    deadline = time.monotonic() + timeout
    while len(pool._waiters) < count:
        assert time.monotonic() < deadline, f"{count} waiter(s) never queued"
        time.sleep(0.005)


def _run_in_thread(target: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Run ``target`` in a thread; the dict gets ``result`` or ``error`` and ``elapsed``."""
    box: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["result"] = target()
        except BaseException as e:
            box["error"] = e
        box["elapsed"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# -- basics ------------------------------------------------------------------------


def test_create_sizes_the_segment(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=3)
    assert os.path.exists(shm_path(pool.region_name))
    assert pool.region_name.startswith(segment.owner_tag() + "_pool_")
    assert pool.segment.size == 3 * identity_layout.slot_bytes
    assert pool.slot_indices == [0, 1, 2]
    stats = pool.stats()
    assert (stats.model, stats.slots, stats.free, stats.busy, stats.pinned, stats.quarantined) == (
        "identity",
        3,
        3,
        0,
        0,
        0,
    )
    assert stats.slot_bytes == identity_layout.slot_bytes


def test_acquire_release_cycle(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=2)
    a = pool.acquire(timeout=1)
    b = pool.acquire(timeout=1)
    assert {a.slot.index, b.slot.index} == {0, 1}
    assert {a.offset, b.offset} == {0, identity_layout.slot_bytes}
    assert a.region_name == pool.region_name
    assert pool.stats().busy == 2 and pool.stats().free == 0
    assert pool.try_acquire() is None
    a.release()
    assert a.released
    assert pool.stats().free == 1
    c = pool.try_acquire()
    assert c is not None and c.slot.index == a.slot.index
    for lease in (b, c):
        lease.release()
    assert pool.stats().free == 2 and pool.stats().busy == 0


def test_release_is_idempotent(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    lease.release()
    lease.release()
    assert pool.stats().free == 1
    first = pool.try_acquire()
    assert first is not None
    assert pool.try_acquire() is None, "a double release must not hand the slot out twice"
    first.release()


def test_context_manager_releases(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    with pool.acquire(timeout=1) as lease:
        assert pool.stats().busy == 1
    assert lease.released
    assert pool.stats().free == 1
    with pytest.raises(RuntimeError), pool.acquire(timeout=1):
        raise RuntimeError("boom")
    assert pool.stats().free == 1


def test_pool_on_chosen_slots(identity_layout: ModelLayout) -> None:
    seg = Segment.create(new_segment_name("test"), 3 * identity_layout.slot_bytes)
    pool = SlotPool(seg, identity_layout, [2])
    try:
        lease = pool.acquire(timeout=1)
        assert lease.offset == 2 * identity_layout.slot_bytes
        lease.input("INPUT0", (1, 4))[:] = 5.0
        spec = identity_layout.input("INPUT0")
        raw = np.frombuffer(seg.mm, np.float32, 4, offset=lease.offset + spec.offset)
        assert raw.tolist() == [5.0] * 4
        del raw
        lease.release()
    finally:
        pool.close()
    assert not os.path.exists(shm_path(seg.name))


def test_pool_constructor_checks(identity_layout: ModelLayout) -> None:
    seg = Segment.create(new_segment_name("test"), 2 * identity_layout.slot_bytes)
    try:
        with pytest.raises(InputError):
            SlotPool(seg, identity_layout, [])
        with pytest.raises(InputError, match="too small"):
            SlotPool(seg, identity_layout, [0, 2])
    finally:
        seg.close()


# -- waiting -----------------------------------------------------------------------


def test_exhaustion_times_out(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    t0 = time.monotonic()
    with pytest.raises(PoolTimeoutError) as info:
        pool.acquire(timeout=0.2)
    elapsed = time.monotonic() - t0
    assert 0.19 <= elapsed < 10  # never early; late only by what a loaded machine costs
    assert info.value.model == "identity" and info.value.timeout_s == 0.2
    # It says where the slots are: here, the only one is in use by this process.
    assert "of 1 slots: 1 in use by this process, 0 kept by live output views" in str(info.value)
    lease.release()


def test_zero_timeout_fails_at_once(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=0)  # free slot: succeeds even with no time to wait
    t0 = time.monotonic()
    with pytest.raises(PoolTimeoutError):
        pool.acquire(timeout=0)
    assert time.monotonic() - t0 < 5  # no wait at all; slack for a loaded machine
    lease.release()


def test_release_from_another_thread_wakes_waiter(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    held = pool.acquire(timeout=1)
    thread, box = _run_in_thread(lambda: pool.acquire(timeout=60))
    wait_for_waiters(pool, 1)
    assert thread.is_alive(), "the waiter should be blocked while the slot is held"
    released_at = time.monotonic()
    held.release()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the waiter must be woken by the release, not by its 60 s timeout"
    assert "error" not in box, box.get("error")
    assert time.monotonic() - released_at < 30
    box["result"].release()
    assert pool.stats().free == 1


def test_many_threads_share_few_slots(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=2)
    in_use: set[int] = set()
    lock = threading.Lock()
    clashes: list[int] = []

    def worker() -> None:
        for _ in range(20):
            with pool.acquire(timeout=10) as lease:
                with lock:
                    if lease.slot.index in in_use:
                        clashes.append(lease.slot.index)
                    in_use.add(lease.slot.index)
                time.sleep(0.0005)
                with lock:
                    in_use.discard(lease.slot.index)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not clashes
    assert pool.stats().free == 2


def test_acquire_async(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)

    async def main() -> tuple[int, float, float]:
        first = await pool.acquire_async(timeout=1)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, first.release)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        t0 = time.monotonic()
        second = await pool.acquire_async(timeout=60)
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        with pytest.raises(PoolTimeoutError):
            await pool.acquire_async(timeout=0.1)
        timed_out_after = time.monotonic() - t1
        tick_task.cancel()
        second.release()
        return ticks, waited, timed_out_after

    ticks, waited, timed_out_after = asyncio.run(main())
    assert 0.03 <= waited < 30  # woken by the release (at 0.05 s), not by its 60 s timeout
    assert ticks >= 3, "acquire_async must not block the event loop"
    assert 0.09 <= timed_out_after < 10
    assert pool.stats().free == 1


# -- views ---------------------------------------------------------------------------


def test_input_views_are_writable_and_land_in_shared_memory(
    make_pool: MakePool, multi_io_layout: ModelLayout
) -> None:
    pool = make_pool(multi_io_layout, slots=2)
    other = pool.acquire(timeout=1)
    lease = pool.acquire(timeout=1)
    image = lease.input("IMAGE", (2, 3, 8, 5))
    ids = lease.input("IDS", (2, 10))
    assert image.shape == (2, 3, 8, 5) and image.dtype == np.float32
    assert ids.shape == (2, 10) and ids.dtype == np.int64
    assert image.flags.writeable and ids.flags.writeable
    assert lease.input_shapes == {"IMAGE": (2, 3, 8, 5), "IDS": (2, 10)}
    data = np.random.default_rng(0).random((2, 3, 8, 5), dtype=np.float32)
    image[:] = data
    ids[:] = np.arange(20).reshape(2, 10)

    # The bytes are in the segment at the slot's offset, as another process would see them.
    attached = Segment.attach(pool.region_name)
    try:
        spec = multi_io_layout.input("IMAGE")
        raw = np.frombuffer(attached.mm, np.float32, data.size, offset=lease.offset + spec.offset)
        np.testing.assert_array_equal(raw.reshape(data.shape), data)
        ids_spec = multi_io_layout.input("IDS")
        raw_ids = np.frombuffer(attached.mm, np.int64, 20, offset=lease.offset + ids_spec.offset)
        assert raw_ids.tolist() == list(range(20))
        # The other slot was not touched.
        raw_other = np.frombuffer(attached.mm, np.float32, data.size, offset=other.offset + spec.offset)
        assert not raw_other.any()
        del raw, raw_ids, raw_other
    finally:
        attached.close()
    del image, ids
    lease.release()
    other.release()


def test_unbatched_lease_shapes(make_pool: MakePool, unbatched_layout: ModelLayout) -> None:
    pool = make_pool(unbatched_layout, slots=1)
    with pool.acquire(timeout=1) as lease:
        assert lease.input("A", (2, 3)).shape == (2, 3)
        assert lease.input("B", (16,)).shape == (16,)
        for bad in [(1, 2, 3), (2, 4), (17,)]:
            with pytest.raises(InputError):
                lease.input("A" if len(bad) != 1 else "B", bad)


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("IMAGE", (2, 3, 8), "rank"),  # rank
        ("IMAGE", (2, 3, 8, 5, 1), "rank"),
        ("IMAGE", (2, 4, 8, 5), "does not match"),  # fixed channel dim
        ("IMAGE", (5, 3, 8, 5), "too big"),  # batch above capacity 4
        ("IMAGE", (2, 3, 33, 5), "too big"),  # above max_shapes
        ("IMAGE", (2, 3, -1, 5), "does not match"),
        ("IDS", (2, 11), "does not match"),
        ("SCORES", (2, 10), "no input"),  # an output, not an input
        ("NOPE", (1,), "no input"),
    ],
)
def test_input_rejects_bad_shapes(
    make_pool: MakePool, multi_io_layout: ModelLayout, name: str, shape: tuple, match: str
) -> None:
    pool = make_pool(multi_io_layout, slots=1)
    with pool.acquire(timeout=1) as lease:
        with pytest.raises(InputError, match=match):
            lease.input(name, shape)
        assert name not in lease.input_shapes


def test_output_views_are_read_only(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    with pool.acquire(timeout=1) as lease:
        lease.slot.arrays["OUTPUT0"][:8] = np.arange(8)
        out = lease.output("OUTPUT0", (2, 4))
        assert out.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert not out.flags.writeable
        with pytest.raises(ValueError):
            out[0, 0] = 1
        with pytest.raises(InputError):
            lease.output("INPUT0", (2, 4))
        with pytest.raises(InputError):
            lease.output("OUTPUT0", (3, 4))  # capacity is 2
        del out


def test_live_output_view_pins_slot(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    lease.slot.arrays["OUTPUT0"][:4] = [1, 2, 3, 4]
    out = lease.output("OUTPUT0", (1, 4))
    lease.release()
    stats = pool.stats()
    assert stats.pinned == 1 and stats.free == 0 and stats.busy == 0
    assert pool.try_acquire() is None, "a slot with live views must not be handed out"
    with pytest.raises(PoolTimeoutError):
        pool.acquire(timeout=0.1)
    assert out.tolist() == [[1, 2, 3, 4]]
    del out
    gc.collect()
    again = pool.try_acquire()
    assert again is not None and again.slot.index == lease.slot.index
    assert pool.stats().pinned == 0
    again.release()
    assert pool.stats().free == 1


def test_a_view_that_dies_while_the_pool_reclaims_never_loses_its_slot(
    make_pool: MakePool, identity_layout: ModelLayout
) -> None:
    """A view of a released lease may die in another thread while a taker reclaims pinned slots:
    seen alive, then dead, its slot is freed now or at the next take, never dropped from both."""
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (1, 4))
    lease.release()
    index, ref = pool._pinned[0]

    class DiesWhileLookedAt:
        """The view's weak reference: alive at the first look, dead from the second on."""

        looks = 0

        def __call__(self) -> np.ndarray | None:
            self.looks += 1
            return ref() if self.looks == 1 else None

    pool._pinned[0] = (index, DiesWhileLookedAt())
    first = pool.try_acquire()
    again = first or pool.try_acquire()
    assert again is not None and again.slot.index == index, pool.stats()
    again.release()
    del out
    stats = pool.stats()
    assert (stats.free, stats.busy, stats.pinned) == (1, 0, 0)


def test_a_view_whose_last_reference_is_the_pools_own_look_frees_its_slot_once(
    make_pool: MakePool, identity_layout: ModelLayout
) -> None:
    """When the pool's look at a pinned view holds the view's last reference, the view dies in the
    pool's own thread, under its lock, and its callback runs there: the slot is freed once."""
    import weakref

    pool = make_pool(identity_layout, slots=2)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (1, 4))
    lease.release()
    index, _ = pool._pinned[0]
    holder = [np.zeros(4)]
    real = weakref.ref(holder[0], pool._views_gone)

    class LastLook:
        """A weak reference whose first look hands over the only strong reference there is."""

        def __call__(self) -> np.ndarray | None:
            return holder.pop() if holder else real()

    pool._pinned[0] = (index, LastLook())
    del out
    taken = [pool.try_acquire(), pool.try_acquire(), pool.try_acquire()]
    assert sum(lease is not None for lease in taken) == 2, pool.stats()
    for lease in taken:
        if lease is not None:
            lease.release()
    stats = pool.stats()
    assert (stats.free, stats.busy, stats.pinned) == (2, 0, 0), stats
    assert sorted(pool._free) == [0, 1]


def test_slot_frees_itself_when_its_last_view_dies(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (1, 4))
    lease.release()
    assert pool.stats().pinned == 1
    del out  # no acquire in between: the view's death alone returns the slot
    stats = pool.stats()
    assert (stats.pinned, stats.free) == (0, 1)


def test_waiter_wakes_when_the_last_view_dies(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (1, 4))
    lease.release()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60)))
    waiter.start()
    wait_for_waiters(pool, 1)  # it is blocked on the pinned slot before the view dies
    del out
    waiter.join(timeout=30)
    assert not waiter.is_alive() and len(got) == 1
    got[0].release()
    assert pool.stats().free == 1


def test_derived_views_keep_slot_pinned(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (2, 4))
    row = out[1]  # a view of a view
    as_bytes = memoryview(lease.input("INPUT0", (1, 4)))  # a buffer export of a view
    del out
    lease.release()
    assert pool.try_acquire() is None
    del row
    assert pool.try_acquire() is None, "the memoryview of an input view still points into the slot"
    del as_bytes
    again = pool.try_acquire()
    assert again is not None
    again.release()


def test_waiter_gets_slot_once_views_die(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    view = lease.input("INPUT0", (2, 4))
    lease.release()
    assert pool.stats().pinned == 1
    thread, box = _run_in_thread(lambda: pool.acquire(timeout=60))
    wait_for_waiters(pool, 1)
    assert thread.is_alive()
    del view  # no notify happens here: the waiter has to poll
    thread.join(timeout=30)
    assert "result" in box, box  # the view's death freed it, not the 60 s timeout
    assert box["elapsed"] < 30
    box["result"].release()


def test_pinned_slot_is_skipped_for_free_ones(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=2)
    lease = pool.acquire(timeout=1)
    pinned_index = lease.slot.index
    view = lease.output("OUTPUT0", (1, 4))
    lease.release()
    other = pool.acquire(timeout=1)
    assert other.slot.index != pinned_index
    assert pool.try_acquire() is None
    other.release()
    del view


def test_views_without_references_do_not_pin(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    with pool.acquire(timeout=1) as lease:
        lease.input("INPUT0", (2, 4))[:] = 1.0
        float(lease.output("OUTPUT0", (2, 4)).sum())
    assert pool.stats().free == 1 and pool.stats().pinned == 0


def test_lease_unusable_after_release(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    lease = pool.acquire(timeout=1)
    lease.input("INPUT0", (1, 4))
    lease.release()
    assert lease.input_shapes == {}
    with pytest.raises(LeaseReleasedError):
        lease.input("INPUT0", (1, 4))
    with pytest.raises(LeaseReleasedError):
        lease.output("OUTPUT0", (1, 4))


# -- quarantine ------------------------------------------------------------------------


def test_in_doubt_slot_is_quarantined(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    # Long enough that a loaded machine cannot let it run out before the checks below.
    pool = make_pool(identity_layout, slots=1, quarantine_s=3.0)
    assert pool.quarantine_s == 3.0
    lease = pool.acquire(timeout=1)
    lease.mark_in_doubt()
    released_at = time.monotonic()
    lease.release()
    stats = pool.stats()
    assert stats.quarantined == 1 and stats.free == 0 and stats.busy == 0
    assert pool.try_acquire() is None
    with pytest.raises(PoolTimeoutError):
        pool.acquire(timeout=0.1)
    again = pool.acquire(timeout=30)
    assert time.monotonic() - released_at >= 2.99
    assert pool.stats().quarantined == 0
    again.release()
    assert pool.stats().free == 1  # a normal release after quarantine is not quarantined again


def test_quarantine_ends_without_views_alive_only(make_pool: MakePool, identity_layout: ModelLayout) -> None:
    """After quarantine a slot is still not reused while views from its lease are alive."""
    pool = make_pool(identity_layout, slots=1, quarantine_s=0.1)
    lease = pool.acquire(timeout=1)
    view = lease.input("INPUT0", (2, 4))
    view[:] = 3.0
    lease.mark_in_doubt()
    lease.release()
    time.sleep(0.15)
    assert pool.try_acquire() is None, "quarantine over, but a view still points into the slot"
    assert pool.stats().pinned == 1
    assert view.tolist() == [[3.0] * 4] * 2
    del view
    again = pool.try_acquire()
    assert again is not None
    again.release()


# -- close ---------------------------------------------------------------------------


def test_close_is_idempotent_and_unlinks(identity_layout: ModelLayout) -> None:
    pool = SlotPool.create(identity_layout, 2)
    path = shm_path(pool.region_name)
    assert os.path.exists(path)
    pool.close()
    assert not os.path.exists(path)
    pool.close()
    with pytest.raises(PoolClosedError):
        pool.try_acquire()
    with pytest.raises(PoolClosedError):
        pool.acquire(timeout=1)
    with pytest.raises(PoolClosedError):
        asyncio.run(pool.acquire_async(timeout=1))


def test_close_wakes_waiters(identity_layout: ModelLayout) -> None:
    pool = SlotPool.create(identity_layout, 1)
    held = pool.acquire(timeout=1)
    waiters = [_run_in_thread(lambda: pool.acquire(timeout=60)) for _ in range(3)]
    wait_for_waiters(pool, 3)
    assert all(t.is_alive() for t, _ in waiters)
    closed_at = time.monotonic()
    pool.close()
    for thread, _ in waiters:
        thread.join(timeout=30)
    assert time.monotonic() - closed_at < 30  # woken by close(), not by their 60 s timeout
    for thread, box in waiters:
        assert not thread.is_alive()
        assert isinstance(box.get("error"), PoolClosedError), box
    held.release()  # releasing after close is harmless
    assert not os.path.exists(shm_path(pool.region_name))


def test_close_with_pinned_views(identity_layout: ModelLayout) -> None:
    pool = SlotPool.create(identity_layout, 1)
    lease = pool.acquire(timeout=1)
    view = lease.input("INPUT0", (2, 4))
    view[:] = 7.0
    lease.release()
    assert pool.stats().pinned == 1
    pool.close()
    assert not os.path.exists(shm_path(pool.region_name))
    # The memory stays mapped while the view lives: reading it must not crash.
    assert view.tolist() == [[7.0] * 4] * 2
    del view


def test_close_with_unreleased_lease(identity_layout: ModelLayout) -> None:
    pool = SlotPool.create(identity_layout, 1)
    lease = pool.acquire(timeout=1)
    out = lease.output("OUTPUT0", (1, 4))
    pool.close()
    assert not os.path.exists(shm_path(pool.region_name))
    assert out.shape == (1, 4)
    del out
    lease.release()


def test_lease_used_after_its_pool_closed_is_a_typed_error(identity_layout: ModelLayout) -> None:
    pool = SlotPool.create(identity_layout, 1)
    lease = pool.acquire(timeout=1)
    pool.close()
    with pytest.raises(PoolClosedError):
        lease.input("INPUT0", (1, 4))
    with pytest.raises(PoolClosedError):
        lease.output("OUTPUT0", (1, 4))
    with pytest.raises(PoolClosedError):
        lease.write_input("INPUT0", np.ones((1, 4), np.float32))
    with pytest.raises(PoolClosedError):
        lease.copy_output("OUTPUT0", (1, 4))
    lease.release()


def test_view_outliving_an_attached_pool_keeps_its_values(identity_layout: ModelLayout) -> None:
    """A closed pool's slots may go to another process: a surviving view must keep its values."""
    owner = SlotPool.create(identity_layout, 2)
    try:
        attached = SlotPool(Segment.attach(owner.region_name), identity_layout, [1])
        lease = attached.acquire(timeout=1)
        lease.input("INPUT0", (2, 4))[:] = 7.0
        view = lease.output("OUTPUT0", (2, 4))
        owner_out = owner._slots[1].arrays["OUTPUT0"]  # slot 1 seen through the owner's mapping
        owner_out[:8] = 5.0
        np.testing.assert_array_equal(view, np.full((2, 4), 5.0, np.float32))
        lease.release()
        attached.close()  # the view is alive: the slot's pages become this process's own copy
        owner_out[:8] = -1.0  # the slot's next user writes its own answer
        np.testing.assert_array_equal(view, np.full((2, 4), 5.0, np.float32))
        assert float(view.sum()) == 40.0
        del view
        gc.collect()
    finally:
        owner.close()
