"""A shared-memory segment carved into slots, leased one at a time (:mod:`.lease`).

A pool hands out a :class:`Lease` per slot. A lease can expose zero-copy
numpy views into its slot; every one of them is a view of one array (the
lease's "anchor") made for that lease alone. When the lease ends the pool
keeps only a weak reference to the anchor: while any view is alive the anchor
is too, and the slot is held back ("pinned") until they are gone, so a view
can never see a later request's data.

(Releasing a memoryview cannot detect this: ``np.frombuffer`` wraps a
memoryview argument in a new memoryview on the same buffer, so the lease's own
memoryview has no exports and its ``release()`` always succeeds.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.shm.lease import Lease, Slot
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable, close_kept
from ray_triton_shm._private.shm.validate import check_indices
from ray_triton_shm.errors import (
    LayoutMismatchError,
    PoolClosedError,
    PoolTimeoutError,
    SharedMemoryError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's slots."""

    model: str
    slots: int
    free: int
    busy: int
    pinned: int
    quarantined: int
    slot_bytes: int


class SlotPool:
    """Slots of one model in one segment.

    Args:
        segment: The mapped segment; the pool closes it on :meth:`close`.
        layout: Placement of the model's tensors in a slot.
        slot_indices: Which slots of the segment this pool may hand out.
        quarantine_s: How long a slot whose request may still be running on
            the server (client-side timeout) is held back before reuse.
    """

    def __init__(
        self,
        segment: Segment,
        layout: ModelLayout,
        slot_indices: Iterable[int],
        *,
        quarantine_s: float = 30.0,
    ) -> None:
        self.segment = segment
        self._base = memoryview(segment.mm)
        indices = check_indices(slot_indices, layout, segment.size, segment.name)
        self._setup(
            layout, {i: Slot(i, i * layout.slot_bytes, layout, self._base) for i in indices}, quarantine_s
        )

    memory = "system"
    """What kind of memory the slots are in: ``"system"`` here, ``"cuda"`` for CUDA pools."""

    def _setup(self, layout: ModelLayout, slots: dict[int, Any], quarantine_s: float) -> None:
        """The leasing state, shared by every kind of pool."""
        self.layout = layout
        self.quarantine_s = quarantine_s
        self._slots = slots
        self._free: deque[int] = deque(slots)
        self._pinned: list[tuple[int, weakref.ref[np.ndarray]]] = []
        self._quarantined: list[tuple[int, float, weakref.ref[np.ndarray] | None]] = []
        self._timers: set[threading.Timer] = set()  # one per held-back slot, until its quarantine ends
        self._cond = threading.Condition()
        # Blocked acquirers, first come first served: without the queue a newcomer
        # can take each freed slot before a woken waiter runs, starving it until timeout.
        self._waiters: deque[object] = deque()
        self._closed = False
        # Shared with other processes (see share()): a slot is ours only while we hold its table lock.
        self._table: SlotTable | None = None
        self._max_in_use: int | None = None

    def share(self, table: SlotTable, max_in_use: int | None = None) -> None:
        """Use the slots only while holding them in ``table``, shared with other processes.

        Every slot of the region is then a candidate: a lease takes one that no
        other process uses, and a slot goes back to the table when its lease
        ends (or, held back, when its quarantine or its last view does).

        Args:
            table: The pool's slot table (attached; this pool closes it).
            max_in_use: At most this many slots held by this process at once (None: no cap).
        """
        with self._cond:
            self._table, self._max_in_use = table, max_in_use

    @classmethod
    def create(cls, layout: ModelLayout, slots: int, *, quarantine_s: float = 30.0) -> SlotPool:
        """Create a new owned segment for ``slots`` slots of ``layout``.

        Raises:
            SharedMemoryError: The segment could not be created or reserved.
        """
        segment = Segment.create(new_segment_name("pool"), slots * layout.slot_bytes)
        return cls(segment, layout, range(slots), quarantine_s=quarantine_s)

    @property
    def region_name(self) -> str:
        """The name this pool's segment is registered under in Triton."""
        return self.segment.name

    @property
    def region_bytes(self) -> int:
        """Size of the region registered in Triton (every slot's span lies inside it)."""
        return self.segment.size

    @property
    def slot_indices(self) -> list[int]:
        return sorted(self._slots)

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now: this process's, and 1 more if another process's
        callers wait for the slots this pool shares with it."""
        with self._cond:
            others = 0
            if self._table is not None:
                with contextlib.suppress(SharedMemoryError):
                    others = int(self._table.others_waiting())
            return len(self._waiters) + others

    def _wait_locked(self, me: object) -> None:
        """Queue ``me`` for a slot (with the pool's lock held); the first waiter shows it to the
        processes this pool's slots are shared with."""
        self._waiters.append(me)
        if len(self._waiters) == 1 and self._table is not None:
            with contextlib.suppress(SharedMemoryError):
                self._table.set_waiting(True)

    def _stop_waiting_locked(self, me: object) -> None:
        self._waiters.remove(me)
        if not self._waiters and self._table is not None:
            with contextlib.suppress(SharedMemoryError):
                self._table.set_waiting(False)

    # -- leasing -----------------------------------------------------------
    def _to_free_locked(self, index: int) -> None:
        if self._table is not None:
            self._table.release(index)
        self._free.append(index)

    def _free_or_pin_locked(self, index: int, anchor: weakref.ref[np.ndarray] | None) -> None:
        view = anchor() if anchor is not None else None
        if view is None:
            self._to_free_locked(index)
            return
        # Pinned while this reference keeps the view alive: if it is the last one, the view dies
        # at the del below and its _views_gone (in this thread; the lock is re-entrant) frees it.
        self._pinned.append((index, anchor))
        logger.debug("slot %d of %s pinned by live views", index, self.layout.model)
        del view

    def _views_gone(self, _ref: weakref.ref[np.ndarray]) -> None:
        # The last view of a released lease died: free its slot now and wake a
        # waiter, rather than leaving it to the waiters' 50 ms poll. Nothing pinned
        # (the lease's views died before it ended): no lock taken. A slot pinned
        # just after this check is reclaimed by the next take or the waiters' poll.
        if not self._pinned:
            return
        with self._cond:
            if not self._closed and self._pinned:
                self._reclaim_locked()
                # Only the first waiter may take the slot, and notify() could wake another.
                self._cond.notify_all()

    def _reclaim_locked(self) -> None:
        if self._quarantined:
            now = time.monotonic()
            expired = [(i, a) for i, u, a in self._quarantined if u <= now]
            self._quarantined = [(i, u, a) for i, u, a in self._quarantined if u > now]
            # Out of quarantine, a slot is still not reused while views point into it.
            for index, anchor in expired:
                self._free_or_pin_locked(index, anchor)
        if self._pinned:
            # One look at each anchor, the entry kept pinned before the look's reference is
            # dropped. A view may die at any moment in another thread; and when the look's
            # reference is the last one, the view dies here, its _views_gone runs in this
            # thread (the lock is re-entrant), finds the entry pinned and frees it, once.
            pinned, self._pinned = self._pinned, []
            for index, anchor in pinned:
                view = anchor()
                if view is None:
                    self._to_free_locked(index)
                else:
                    self._pinned.append((index, anchor))
                del view

    def _take_locked(self) -> Lease | None:
        if self._closed:
            raise PoolClosedError(f"pool of {self.layout.model!r} is closed")
        if not self._free or self._table is not None:
            self._reclaim_locked()
        if self._table is not None:
            return self._take_shared_locked(self._table)
        if self._free:
            return self._new_lease(self._slots[self._free.popleft()])
        return None

    @property
    def retired(self) -> bool:
        """Whether the pool's owner retired it (the model now runs another configuration)."""
        table = self._table
        if table is None or self._closed:
            return False
        try:
            return table.retired
        except ValueError:  # closed by another thread meanwhile
            return False

    def _take_shared_locked(self, table: SlotTable) -> Lease | None:
        if table.retired:
            layout = self.layout
            raise LayoutMismatchError(layout.model, layout.fingerprint, "")
        if self._max_in_use is not None and len(self._slots) - len(self._free) >= self._max_in_use:
            return None
        for _ in range(len(self._free)):
            index = self._free.popleft()
            if table.try_claim(index):
                return self._new_lease(self._slots[index])
            self._free.append(index)  # in use elsewhere: try it again last
        return None

    def try_acquire(self) -> Lease | None:
        """A lease if a slot is free right now and nobody is waiting for one, else None.

        Raises:
            PoolClosedError: The pool is closed.
        """
        with self._cond:
            if self._waiters:
                if self._closed:
                    raise PoolClosedError(f"pool of {self.layout.model!r} is closed")
                return None
            return self._take_locked()

    def _new_lease(self, slot: Any) -> Lease:
        return Lease(self, slot)

    def acquire(self, timeout: float) -> Lease:
        """Wait up to ``timeout`` seconds for a free slot.

        Raises:
            PoolTimeoutError: None became free in time.
            PoolClosedError: The pool is (or got) closed.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            lease = self.try_acquire()
            if lease is not None:
                return lease
            me = object()
            self._wait_locked(me)
            try:
                while True:
                    if self._waiters[0] is me:
                        lease = self._take_locked()
                        if lease is not None:
                            return lease
                    elif self._closed:
                        raise PoolClosedError(f"pool of {self.layout.model!r} is closed")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PoolTimeoutError(self.layout.model, timeout, self._where_locked())
                    # Pinned and quarantined slots, and slots other processes use, free
                    # themselves without a notify.
                    poll = 0.05 if (self._pinned or self._quarantined) else remaining
                    if self._table is not None:
                        poll = min(poll, _SHARED_POLL_S)
                    self._cond.wait(min(remaining, poll))
            finally:
                self._stop_waiting_locked(me)
                if self._waiters:
                    self._cond.notify_all()  # someone else may be first in line now

    async def acquire_async(self, timeout: float) -> Lease:
        """:meth:`acquire` for asyncio code: waits without blocking the event loop.

        It queues with the threads that wait in :meth:`acquire`, in the same order.
        """
        deadline = time.monotonic() + timeout
        lease = self.try_acquire()
        if lease is not None:
            return lease
        me = object()
        with self._cond:
            self._wait_locked(me)
        try:
            delay = 0.0005
            while True:
                with self._cond:
                    if self._waiters[0] is me:
                        lease = self._take_locked()
                        if lease is not None:
                            return lease
                    elif self._closed:
                        raise PoolClosedError(f"pool of {self.layout.model!r} is closed")
                if time.monotonic() >= deadline:
                    with self._cond:
                        where = self._where_locked()
                    raise PoolTimeoutError(self.layout.model, timeout, where)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.01)
        finally:
            with self._cond:
                self._stop_waiting_locked(me)
                self._cond.notify_all()

    def _where_locked(self) -> str:
        """Where this pool's slots are, for a timeout's message."""
        held = len(self._slots) - len(self._free) - len(self._pinned) - len(self._quarantined)
        where = (
            f"of {len(self._slots)} slots: {held} in use by this process, {len(self._pinned)} kept by live "
            f"output views, {len(self._quarantined)} held back after timeouts"
        )
        if self._table is not None:
            state = self._table.state()
            where += f"; {state['in_use'] - held} in use by other processes, {state['protected']} protected"
        if self._max_in_use is not None:
            where += f"; at most {self._max_in_use} per process"
        return where

    def _give_back(self, slot: Slot, anchor: weakref.ref[np.ndarray] | None, quarantine: bool) -> None:
        with self._cond:
            if quarantine:
                self._quarantined.append((slot.index, time.monotonic() + self.quarantine_s, anchor))
                # Back when the quarantine ends, whether or not this process leases again.
                timer = threading.Timer(self.quarantine_s + 0.01, self._quarantine_over)
                timer.daemon = True
                self._timers.add(timer)
                timer.start()
                logger.warning(
                    "slot %d of %s held back %gs: its request may still run on the server",
                    slot.index,
                    self.layout.model,
                    self.quarantine_s,
                )
            else:
                self._free_or_pin_locked(slot.index, anchor)
            if self._waiters:
                # Only the first waiter may take the slot, and notify() could wake another.
                self._cond.notify_all()

    def _quarantine_over(self) -> None:
        # A held-back slot's quarantine has ended: free it now (in the shared table too), not at
        # this process's next lease, which may never come.
        with self._cond:
            self._timers.discard(threading.current_thread())  # this timer: its work ends here
            if not self._closed and self._quarantined:
                self._reclaim_locked()
                if self._waiters:
                    self._cond.notify_all()

    def in_doubt_until(self) -> float:
        """``time.monotonic()`` at which the last held-back (in-doubt) slot leaves quarantine; 0 if none.

        Until then the server may still be using the memory, so a CUDA region
        is not unregistered and freed before it.
        """
        with self._cond:
            return max((until for _, until, _ in self._quarantined), default=0.0)

    def stats(self) -> PoolStats:
        """Counts of free, busy, pinned and quarantined slots."""
        with self._cond:
            free, pinned, quarantined = len(self._free), len(self._pinned), len(self._quarantined)
            return PoolStats(
                model=self.layout.model,
                slots=len(self._slots),
                free=free,
                busy=len(self._slots) - free - pinned - quarantined,
                pinned=pinned,
                quarantined=quarantined,
                slot_bytes=self.layout.slot_bytes,
            )

    def close(self) -> None:
        """Close the pool and its segment. Idempotent; waiting callers get PoolClosedError.

        In a shared pool, held-back slots stay protected in the slot table until
        their quarantine ends, and slots with live views stay locked until the
        views are gone, so no other process reuses them early.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            for slot in self._slots.values():
                slot.arrays.clear()
            if self._table is not None:
                self._close_table(self._table)
            self._pinned.clear()
            self._quarantined.clear()
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()
        self._release_memory()

    def _close_table(self, table: SlotTable) -> None:
        for index, until, _ in self._quarantined:
            table.release(index, int(until * 1e9))
        live = [(index, anchor()) for index, anchor in self._pinned]
        live = [(index, view) for index, view in live if view is not None]
        fd = table.close(keep=[index for index, _ in live])
        if fd is not None:
            holder = _LockHolder(fd, len(live))
            for _, view in live:
                weakref.finalize(view, holder.drop)

    def _release_memory(self) -> None:
        self._base.release()
        # Views of this pool's slots that outlive it must not see the shared memory change.
        self.segment.close(keep=[(slot.offset, self.layout.slot_bytes) for slot in self._slots.values()])


_SHARED_POLL_S = 0.002


class _LockHolder:
    """Keeps a closed pool's slot-table descriptor (its locks) until the last kept view dies."""

    def __init__(self, fd: int, views: int) -> None:
        self._fd, self._views = fd, views
        self._lock = threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._views -= 1
            if self._views == 0:
                close_kept(self._fd)
