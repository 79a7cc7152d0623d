"""Slot pools in GPU memory, shared with Triton through CUDA IPC.

A :class:`CudaSlotPool` has the interface of the system-memory
:class:`~ray_triton_shm._private.shm.pool.SlotPool` (leases, pinning by live
views, quarantine), over one raw device allocation instead of a POSIX
segment. Lease views are cupy arrays. Each view holds (through cupy's
``UnownedMemory``) the lease's anchor object, so the slot is not reused while
any view is alive, exactly as numpy views do for system pools.

Whoever registered the region with Triton must unregister it (and make sure
Triton let go of it) before the pool is closed: closing frees (or unmaps) the
device memory, as soon as no view of it is alive.

Streams: every copy runs with the pool's GPU current, on a stream of the
pool's own that first waits for the producer's current stream (so a cupy
or torch array still being computed is complete before it is read); before
a request, :meth:`CudaLease.flush` waits for that lease's copies only (an
event), never for the whole device.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.bulk_copy import BulkCopier
from ray_triton_shm._private.shm.cuda import (
    DeviceBuffer,
    as_cupy,
    import_cupy,
    is_device_array,
    require_device,
)
from ray_triton_shm._private.shm.layout import ModelLayout, TensorSpec
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.shm.validate import check_indices
from ray_triton_shm.errors import InputError

logger = logging.getLogger(__name__)

LEAKED: list[DeviceBuffer] = []
"""Regions deliberately never freed (their server could not be shown to have let go of them)."""


class CudaSlot:
    """One slot of a CUDA pool: its offset in the region (tensors are placed as in the layout)."""

    def __init__(self, index: int, offset: int) -> None:
        self.index = index
        self.offset = offset
        self.arrays: dict[str, Any] = {}


class _Anchor:
    """Kept alive by every cupy view of one lease; the pool holds only a weak reference to it."""

    __slots__ = ("__weakref__",)


class CudaSlotPool(SlotPool):
    """Slots of one model in one device allocation.

    Args:
        buffer: The device memory; the pool closes it on :meth:`close`.
        name: The region's name in Triton.
        layout: Placement of the model's tensors in a slot.
        slot_indices: Which slots of the region this pool may hand out.
        quarantine_s: See :class:`~ray_triton_shm._private.shm.pool.SlotPool`.
    """

    memory = "cuda"

    def __init__(
        self,
        buffer: DeviceBuffer,
        name: str,
        layout: ModelLayout,
        slot_indices: Iterable[int],
        *,
        quarantine_s: float = 30.0,
    ) -> None:
        self.buffer = buffer
        self._name = name
        indices = check_indices(slot_indices, layout, buffer.size, name)
        self._setup(layout, {i: CudaSlot(i, i * layout.slot_bytes) for i in indices}, quarantine_s)
        # Every anchor ever handed to views, to keep the memory until the last view dies.
        self._anchors: weakref.WeakSet[_Anchor] = weakref.WeakSet()
        self._stream: Any = None
        self._stream_lock = threading.Lock()

    @classmethod
    def create(
        cls, layout: ModelLayout, slots: int, *, device: int | None = None, quarantine_s: float = 30.0
    ) -> CudaSlotPool:
        """Allocate a region for ``slots`` slots of ``layout`` on ``device`` (this process's numbering).

        Raises:
            CudaUnavailableError: cupy is missing.
            NoGpuError: No such GPU.
            CudaError: The allocation or its IPC handle failed.
        """
        buffer = DeviceBuffer.allocate(slots * layout.slot_bytes, require_device(device))
        return cls(buffer, new_segment_name("cuda"), layout, range(slots), quarantine_s=quarantine_s)

    @property
    def region_name(self) -> str:
        return self._name

    @property
    def region_bytes(self) -> int:
        return self.buffer.size

    @property
    def device(self) -> int:
        """The region's GPU, in this process's numbering."""
        return self.buffer.device

    @property
    def stream(self) -> Any:
        """The pool's own non-blocking copy stream on its GPU (made on first use)."""
        with self._stream_lock:
            if self._stream is None:
                cupy = import_cupy()
                with cupy.cuda.Device(self.device):
                    self._stream = cupy.cuda.Stream(non_blocking=True)
            return self._stream

    def _new_lease(self, slot: Any) -> CudaLease:
        return CudaLease(self, slot)

    def _new_anchor(self) -> _Anchor:
        anchor = _Anchor()
        self._anchors.add(anchor)
        return anchor

    def abandon(self) -> None:
        """Close the pool but never free its memory: the server may still write to it.

        The buffer is kept in :data:`LEAKED` for the life of the process. Idempotent.
        """
        if self._closed:
            return
        LEAKED.append(self.buffer)
        self._release_memory = lambda: None  # type: ignore[method-assign]
        self.close()

    def _release_memory(self) -> None:
        """Free the memory now, or when the last live cupy view of it dies."""
        alive = list(self._anchors)
        if not alive:
            self.buffer.close()
            return
        logger.info(
            "pool %s closed with %d lease(s) still viewed: its GPU memory is freed when they die",
            self._name,
            len(alive),
        )
        remaining = [len(alive)]
        lock = threading.Lock()
        buffer = self.buffer

        def gone() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                buffer.close()

        for anchor in alive:
            weakref.finalize(anchor, gone)
        del alive, anchor


class CudaLease(Lease):
    """A lease on a CUDA slot; :meth:`input` and :meth:`output` return cupy views.

    cupy arrays cannot be made read-only, so output views are writable;
    writing to them changes only this slot.
    """

    pool: CudaSlotPool

    def __init__(self, pool: CudaSlotPool, slot: Any) -> None:
        super().__init__(pool, slot)
        self._flat: Any = None
        # Sources of copies queued on the pool's stream, kept alive until flush() saw them done.
        self._pending: list[Any] = []
        # Whether input views were handed out, which the caller may fill on its own stream.
        self._filled_in_place = False

    def _lease_anchor(self) -> Any:
        if self._flat is None:
            self._anchor = self.pool._new_anchor()  # type: ignore[assignment]
            self._flat = self.pool.buffer.as_cupy(self._anchor, self.slot.offset, self.layout.slot_bytes)
        return self._flat

    def input(self, name: str, shape: Sequence[int]) -> Any:
        """A writable cupy view of input ``name`` to fill in place (see :meth:`Lease.input`).

        Fill it with the pool's GPU current: :meth:`flush` waits for that GPU's
        current stream before the request. Work on other streams must be
        synchronised by the caller.

        Raises:
            InputError: Unknown name or a shape that does not fit.
            LeaseReleasedError: The lease has ended.
        """
        view = super().input(name, shape)
        self._filled_in_place = True
        return view

    def _dtype_view(self, spec: TensorSpec, shape: Sequence[int]) -> Any:
        """A contiguous view of ``spec``'s region in the slot with ``shape`` (already validated)."""
        nbytes = math.prod(shape) * spec.dtype.itemsize
        region = self._lease_anchor()[spec.offset : spec.offset + nbytes]
        return region.view(spec.dtype).reshape(tuple(shape))

    def _spec(self, name: str, kind: str) -> TensorSpec:
        spec = self.layout.input(name) if kind == "input" else self.layout.output(name)
        if spec is None:
            raise InputError(f"model {self.layout.model!r} has no {kind} {name!r}")
        return spec

    def write_input(self, name: str, value: Any, copier: BulkCopier | None = None) -> tuple[int, ...]:
        """Copy ``value`` into input ``name``: device to device for CUDA arrays, host to device for numpy.

        The copy is queued on the pool's stream after the work already queued
        on the producer's current stream; :meth:`flush` waits for it.
        ``copier`` (for host copies) has nothing to do here: the GPU copies.

        Raises:
            InputError: The model has no input ``name``.
        """
        cupy = import_cupy()
        self._check_live()
        shape = tuple(int(d) for d in value.shape)
        stream = self.pool.stream
        with cupy.cuda.Device(self.pool.device):
            target = self._dtype_view(self._spec(name, "input"), shape)
            if isinstance(value, np.ndarray):
                host = np.ascontiguousarray(value)
                target.set(host, stream=stream)
                self._pending.append(host)
                return shape
            source = as_cupy(value) if is_device_array(value) else cupy.asarray(value)
        with source.device:
            if not source.flags.c_contiguous:
                source = cupy.ascontiguousarray(source)
            # What produced the source (and the contiguous copy) is queued on its current stream.
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.get_current_stream())
        with cupy.cuda.Device(self.pool.device):
            stream.wait_event(ready)
            # A plain memcpy also crosses GPUs (unified addressing), which an elementwise copy cannot.
            target.data.copy_from_device_async(source.data, source.nbytes, stream)
        self._pending.append(source)
        return shape

    def copy_output(self, name: str, shape: Sequence[int], copier: BulkCopier | None = None) -> Any:
        """A cupy copy of output ``name`` on the pool's GPU, independent of the slot (``copier`` unused).

        The copy is queued on the caller's current stream of that GPU, so the
        caller's later work there is ordered after it.

        Raises:
            InputError: The model has no output ``name``.
        """
        cupy = import_cupy()
        self._check_live()
        with cupy.cuda.Device(self.pool.device):
            return self._dtype_view(self._spec(name, "output"), shape).copy()

    def flush(self) -> None:
        """Wait until the inputs are complete, so Triton reads them whole.

        That is this lease's copies queued on the pool's stream and, if input
        views were handed out, the work queued so far on the caller's current
        stream of the pool's GPU (where it filled them). Never the whole device.
        """
        if not (self._pending or self._filled_in_place):
            return
        cupy = import_cupy()
        with cupy.cuda.Device(self.pool.device):
            streams = [cupy.cuda.get_current_stream()] if self._filled_in_place else []
            if self._pending:
                streams.append(self.pool.stream)
            for stream in streams:
                done = cupy.cuda.Event(disable_timing=True)
                done.record(stream)
                done.synchronize()
        self._pending.clear()

    def release(self) -> None:
        """Give the slot back. Idempotent. Live views keep it pinned."""
        if self._pending and not self.released:  # (in-place fills are the caller's to finish)
            try:
                self.flush()  # copies into the slot must end before anyone else gets it
            except Exception:
                logger.exception("waiting for copies into slot %d failed", self.slot.index)
        self._flat = None
        super().release()
