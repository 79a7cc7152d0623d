"""A lease: one slot of a :class:`~ray_triton_shm._private.shm.pool.SlotPool`, used exclusively.

Its views (:meth:`Lease.input`, :meth:`Lease.output`) point straight into the
slot; all of them are views of one array made for the lease alone (its
"anchor"), which the pool watches once the lease ends, so the slot is not
reused while any view is alive.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ray_triton_shm._private.shm.bulk_copy import BulkCopier
from ray_triton_shm._private.shm.bytes_tensor import parse, serialize_into
from ray_triton_shm._private.shm.cuda import import_cupy
from ray_triton_shm._private.shm.layout import ModelLayout, TensorSpec
from ray_triton_shm._private.shm.validate import check_shape
from ray_triton_shm.errors import InputError, LeaseReleasedError, PoolClosedError


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


class LeasedPool(Protocol):
    """What a lease asks of the pool it came from (a :class:`~ray_triton_shm._private.shm.pool.SlotPool`)."""

    layout: ModelLayout
    _closed: bool
    _base: Any
    _table: Any

    @property
    def region_name(self) -> str: ...

    def _views_gone(self, ref: weakref.ref[np.ndarray]) -> None: ...

    def _give_back(self, slot: Slot, anchor: weakref.ref[np.ndarray] | None, quarantine: bool) -> None: ...


class Lease:
    """Exclusive use of one slot until :meth:`release` (or the ``with`` block ends).

    Views from :meth:`input` and :meth:`output` point straight into the slot.
    Once the lease ends the slot is not reused while any of them is alive.
    """

    def __init__(self, pool: LeasedPool, slot: Slot) -> None:
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
        layout = self.layout
        start, end, dtype = _span(spec, tuple(shape), layout.batched, layout.batch_capacity)
        return self._lease_anchor()[start:end].view(dtype).reshape(shape)

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


@functools.lru_cache(maxsize=1024)
def _span(
    spec: TensorSpec, shape: tuple[int, ...], batched: bool, capacity: int
) -> tuple[int, int, np.dtype]:
    """Where a tensor of ``shape`` lies in a slot (start, end, dtype), checked once per shape.

    Raises:
        InputError: The shape does not fit ``spec`` (not cached: raised each time).
    """
    count = check_shape(spec, shape, batched, capacity)
    dtype = spec.dtype
    return spec.offset, spec.offset + count * dtype.itemsize, dtype
