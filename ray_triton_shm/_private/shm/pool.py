"""A shared-memory segment carved into slots, and leases on those slots.

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
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.bulk_copy import BulkCopier
from ray_triton_shm._private.shm.bytes_tensor import parse, serialize_into
from ray_triton_shm._private.shm.cuda import import_cupy
from ray_triton_shm._private.shm.layout import ModelLayout, TensorSpec
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable, close_kept
from ray_triton_shm._private.shm.validate import check_indices, check_shape
from ray_triton_shm.errors import (
    InputError,
    LayoutMismatchError,
    LeaseReleasedError,
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


class Slot:
    """One slot: its offset in the segment and flat arrays over each tensor's region."""

    def __init__(self, index: int, offset: int, layout: ModelLayout, base: memoryview) -> None:
        self.index = index
        self.offset = offset
        self.arrays: dict[str, np.ndarray] = {}
        for spec in (*layout.inputs, *layout.outputs):
            self.arrays[spec.name] = np.frombuffer(
                base,
                dtype=spec.dtype,
                count=spec.capacity // spec.dtype.itemsize,
                offset=offset + spec.offset,
            )


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


class Lease:
    """Exclusive use of one slot until :meth:`release` (or the ``with`` block ends).

    Views from :meth:`input` and :meth:`output` point straight into the slot.
    Once the lease ends the slot is not reused while any of them is alive.
    """

    def __init__(self, pool: SlotPool, slot: Slot) -> None:
        self.pool = pool
        self.slot = slot
        self._anchor: np.ndarray | None = None
        self._released = False
        self._quarantine = False
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        # Serialised sizes of the BYTES inputs written by write_input.
        self.input_nbytes: dict[str, int] = {}

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    @property
    def layout(self) -> ModelLayout:
        return self.pool.layout

    @property
    def region_name(self) -> str:
        return self.pool.region_name

    @property
    def offset(self) -> int:
        """Byte offset of the slot in its segment."""
        return self.slot.offset

    def _check_live(self) -> None:
        if self._released:
            raise LeaseReleasedError("this lease was released; its slot may belong to someone else")
        if self.pool._closed:  # its memory is unmapped, or about to be
            raise PoolClosedError(f"pool of {self.layout.model!r} is closed")

    def _lease_anchor(self) -> np.ndarray:
        """The slot's bytes as one array that every view of this lease keeps alive (as its base)."""
        if self._anchor is None:
            self._anchor = np.frombuffer(self.pool._base, np.uint8, self.layout.slot_bytes, self.slot.offset)
        return self._anchor

    def _array(self, spec: TensorSpec, shape: Sequence[int]) -> np.ndarray:
        count = check_shape(spec, shape, self.layout.batched, self.layout.batch_capacity)
        start = spec.offset
        region = self._lease_anchor()[start : start + count * spec.dtype.itemsize]
        return region.view(spec.dtype).reshape(shape)

    def input(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A writable view of input ``name`` with ``shape``, to fill in place.

        The shape is remembered for the next inference on this lease.

        Raises:
            InputError: Unknown name or a shape that does not fit.
            LeaseReleasedError: The lease has ended.
            PoolClosedError: The pool was closed.
        """
        self._check_live()
        spec = self.layout.input(name)
        if spec is None:
            raise InputError(f"model {self.layout.model!r} has no input {name!r}")
        if spec.is_bytes:
            raise InputError(
                f"{name} is a BYTES tensor: it cannot be filled in place; write_input() "
                "(or infer()) serialises it into the slot"
            )
        array = self._array(spec, shape)
        self.input_shapes[name] = tuple(int(d) for d in shape)
        return array

    def output(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A read-only view of output ``name`` with ``shape``.

        A BYTES output is parsed out of the slot instead (an ``object`` array
        of ``bytes``, a copy: strings cannot be viewed in place).

        Raises:
            InputError: Unknown name or a shape that does not fit.
            LeaseReleasedError: The lease has ended.
            PoolClosedError: The pool was closed.
            TritonCallError: A BYTES output's lengths run past its region.
        """
        self._check_live()
        spec = self.layout.output(name)
        if spec is None:
            raise InputError(f"model {self.layout.model!r} has no output {name!r}")
        if spec.is_bytes:
            return self._parse_bytes(spec, shape)
        array = self._array(spec, shape)
        if isinstance(array, np.ndarray):  # device arrays (CUDA leases) have no read-only flag
            array.flags.writeable = False
        return array

    def write_input(self, name: str, value: Any, copier: BulkCopier | None = None) -> tuple[int, ...]:
        """Copy ``value`` (validated already) into input ``name``'s region; return its shape.

        A CUDA array is copied to the host first: this is system memory.
        ``copier`` splits a large copy across threads. A BYTES input (an
        ``object`` array of ``bytes``) is serialised into the region in
        Triton's form; its size is kept in :attr:`input_nbytes` and its shape
        in :attr:`input_shapes` (so that ``client.run(lease)`` sends it).

        Raises:
            LeaseReleasedError / PoolClosedError: The lease ended or its pool was closed.
            InputError: BYTES elements that are not bytes/str or do not fit the region.
        """
        self._check_live()
        spec = self.layout.input(name)
        if spec is not None and spec.is_bytes:
            # Serialised straight into the region; its size goes with the request.
            self.input_nbytes[name] = serialize_into(self.slot.arrays[name], value)
            self.input_shapes[name] = tuple(value.shape)  # for run(), as input() does
            return tuple(value.shape)
        if not isinstance(value, np.ndarray):
            value = import_cupy().asnumpy(value)
        target = self.slot.arrays[name][: value.size].reshape(value.shape)
        if copier is None:
            np.copyto(target, value, casting="no")
        else:
            copier.copy(target, value)
        return tuple(value.shape)

    def copy_output(self, name: str, shape: Sequence[int], copier: BulkCopier | None = None) -> np.ndarray:
        """A copy of output ``name`` with ``shape``, independent of the slot.

        Raises:
            LeaseReleasedError / PoolClosedError: The lease ended or its pool was closed.
            TritonCallError: A BYTES output's lengths run past its region.
        """
        self._check_live()
        spec = self.layout.output(name)
        if spec is not None and spec.is_bytes:
            return self._parse_bytes(spec, shape)
        view = self.slot.arrays[name][: math.prod(shape)].reshape(shape)
        if copier is None:
            return np.array(view)
        out = np.empty(view.shape, view.dtype)
        copier.copy(out, view)
        return out

    def _parse_bytes(self, spec: TensorSpec, shape: Sequence[int]) -> np.ndarray:
        count = check_shape(spec, shape, self.layout.batched, self.layout.batch_capacity)
        return parse(self.slot.arrays[spec.name], count, self.layout.model).reshape(tuple(shape))

    def flush(self) -> None:
        """Make written inputs visible to the server before a call (nothing to do for system memory)."""

    def mark_in_doubt(self) -> None:
        """Hold the slot back after release: the server may still write to it."""
        self._quarantine = True

    def request_started(self, timeout_s: float | None) -> None:
        """A request on this slot goes to the server now, with a deadline ``timeout_s`` from now (None: none).

        In a pool shared through a slot table, the deadline is written there: if
        this process dies before the answer, the slot stays protected until the
        deadline plus the quarantine.

        Raises:
            PoolClosedError: The pool was closed meanwhile (by another thread).
        """
        pool = self.pool
        if pool._closed:
            raise PoolClosedError(f"pool of {pool.layout.model!r} is closed")
        table = pool._table
        if table is not None:
            table.request_started(self.slot.index, timeout_s)

    def request_ended(self) -> None:
        """The request is over (answered, or refused); a request left in doubt keeps its deadline."""
        table = self.pool._table
        if table is not None and not self._quarantine:
            table.request_ended(self.slot.index)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the slot back. Idempotent."""
        if self._released:
            return
        self._released = True
        self.input_shapes = {}
        self.input_nbytes = {}
        anchor, self._anchor = self._anchor, None
        ref = weakref.ref(anchor, self.pool._views_gone) if anchor is not None else None
        del anchor
        self.pool._give_back(self.slot, ref, self._quarantine)
