"""Slot pools in GPU memory, shared with Triton through CUDA IPC.

A :class:`CudaSlotPool` has the interface of the system-memory
:class:`~ray_triton_shm._private.pool.SlotPool` (leases, pinning by live
views, quarantine), over one raw device allocation instead of a POSIX
segment. Lease views are cupy arrays. Each view holds (through cupy's
``UnownedMemory``) the lease's anchor object, so the slot is not reused while
any view is alive, exactly as numpy views do for system pools.

Whoever registered the region with Triton must unregister it before the
pool is closed: closing frees (or unmaps) the device memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ray_triton_shm._private.bulk_copy import BulkCopier
from ray_triton_shm._private.cuda import DeviceBuffer, as_cupy, import_cupy, is_device_array
from ray_triton_shm._private.layout import ModelLayout
from ray_triton_shm._private.pool import Lease, SlotPool, _check_indices
from ray_triton_shm._private.segment import new_segment_name

logger = logging.getLogger(__name__)


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
        quarantine_s: See :class:`~ray_triton_shm._private.pool.SlotPool`.
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
        indices = _check_indices(slot_indices, layout, buffer.size, name)
        self._setup(layout, {i: CudaSlot(i, i * layout.slot_bytes) for i in indices}, quarantine_s)

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
        from ray_triton_shm._private.cuda import require_device

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

    def _new_lease(self, slot: Any) -> CudaLease:
        return CudaLease(self, slot)

    def _release_memory(self) -> None:
        self.buffer.close()


class CudaLease(Lease):
    """A lease on a CUDA slot; :meth:`input` and :meth:`output` return cupy views.

    cupy arrays cannot be made read-only, so output views are writable;
    writing to them changes only this slot.
    """

    pool: CudaSlotPool

    def __init__(self, pool: CudaSlotPool, slot: Any) -> None:
        super().__init__(pool, slot)
        self._flat: Any = None

    def _lease_anchor(self) -> Any:
        if self._flat is None:
            self._anchor = _Anchor()  # type: ignore[assignment]
            self._flat = self.pool.buffer.as_cupy(self._anchor, self.slot.offset, self.layout.slot_bytes)
        return self._flat

    def _dtype_view(self, name: str, shape: Sequence[int]) -> Any:
        """A contiguous view of ``name``'s region with ``shape`` (already validated)."""
        spec = self.layout.input(name) or self.layout.output(name)
        if spec is None:
            from ray_triton_shm.errors import InputError

            raise InputError(f"model {self.layout.model!r} has no tensor {name!r}")
        nbytes = math.prod(shape) * spec.dtype.itemsize
        region = self._lease_anchor()[spec.offset : spec.offset + nbytes]
        return region.view(spec.dtype).reshape(tuple(shape))

    def write_input(self, name: str, value: Any, copier: BulkCopier | None = None) -> tuple[int, ...]:
        """Copy ``value`` into input ``name``: device to device for CUDA arrays, host to device for numpy.

        ``copier`` (for host copies) has nothing to do here: the GPU copies.
        """
        cupy = import_cupy()
        shape = tuple(int(d) for d in value.shape)
        target = self._dtype_view(name, shape)
        if isinstance(value, np.ndarray):
            target.set(np.ascontiguousarray(value))
            return shape
        source = as_cupy(value) if is_device_array(value) else cupy.asarray(value)
        if source.device.id != self.pool.device or not source.flags.c_contiguous:
            with source.device:
                source = cupy.ascontiguousarray(source)
        # A plain memcpy also crosses GPUs (unified addressing), which an elementwise copy cannot.
        target.data.copy_from_device(source.data, source.nbytes)
        return shape

    def copy_output(self, name: str, shape: Sequence[int], copier: BulkCopier | None = None) -> Any:
        """A cupy copy of output ``name`` on the pool's GPU, independent of the slot (``copier`` unused)."""
        cupy = import_cupy()
        with cupy.cuda.Device(self.pool.device):
            return self._dtype_view(name, shape).copy()

    def flush(self) -> None:
        """Wait for this process's pending GPU work, so Triton reads complete inputs."""
        cupy = import_cupy()
        with cupy.cuda.Device(self.pool.device):
            cupy.cuda.runtime.deviceSynchronize()

    def release(self) -> None:
        """Give the slot back. Idempotent. Live views keep it pinned."""
        self._flat = None
        super().release()
