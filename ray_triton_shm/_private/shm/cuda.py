"""CUDA plumbing for the CUDA slot pools: the lazy cupy import, raw allocations, device arrays.

Nothing here imports cupy at module import time: a CPU-only installation
never needs it, and asking for CUDA memory without it raises
:class:`~ray_triton_shm.errors.CudaUnavailableError` naming the pip extra.
Device-id mapping lives in :mod:`ray_triton_shm._private.shm.cuda_devices`.
"""

from __future__ import annotations

import base64
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ray_triton_shm.errors import CudaError, CudaUnavailableError, NoGpuError

logger = logging.getLogger(__name__)

CUDA_EXTRA = "pip install 'ray-triton-shm[cuda]'"
IPC_HANDLE_BYTES = 64
REGION_ALIGN = 2 << 20
"""Device regions are allocated in whole multiples of this (2 MiB).

The driver sub-allocates smaller ``cudaMalloc`` requests from shared 2 MiB
blocks, and an IPC handle exports the whole block: a region that shares one
would hand Triton our neighbouring allocations too.
"""


def import_cupy() -> ModuleType:
    """Import cupy on first use.

    Returns:
        The ``cupy`` module.

    Raises:
        CudaUnavailableError: cupy is not installed (or fails to import).
    """
    try:
        import cupy  # lazy: cupy is optional (the cuda extra)
    except ImportError as e:
        raise CudaUnavailableError(
            f"CUDA shared memory needs cupy, which cannot be imported ({e}); install it with "
            f"{CUDA_EXTRA} (cupy-cuda12x) or the cupy build matching your CUDA"
        ) from e
    return cupy


def local_gpu_count() -> int:
    """GPUs this process sees through cupy; 0 without cupy or GPUs."""
    try:
        return device_count()
    except CudaUnavailableError:
        return 0


def device_count() -> int:
    """How many GPUs this process sees (0 when CUDA has no usable device).

    Raises:
        CudaUnavailableError: cupy is missing.
    """
    cupy = import_cupy()
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as e:
        logger.debug("no CUDA device: %s", e)
        return 0


def require_device(device: int | None) -> int:
    """The client-visible device index to use: ``device``, or cupy's current one.

    Raises:
        CudaUnavailableError: cupy is missing.
        NoGpuError: No GPU is visible, or ``device`` is out of range.
    """
    count = device_count()
    if count == 0:
        raise NoGpuError(
            "CUDA shared memory was requested but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    if device is None:
        device = int(import_cupy().cuda.runtime.getDevice())
    if not 0 <= device < count:
        raise NoGpuError(f"GPU {device} requested but this process sees {count} GPU(s)")
    return device


# -- raw allocations and IPC handles -------------------------------------
def encode_handle(raw: bytes) -> bytes:
    """A cudaIpcMemHandle_t as ``register_cuda_shared_memory`` takes it: base64 of its 64 bytes.

    Raises:
        CudaError: ``raw`` is not 64 bytes.
    """
    raw = bytes(raw)
    if len(raw) != IPC_HANDLE_BYTES:
        raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    return base64.b64encode(raw)


@dataclass
class DeviceBuffer:
    """Device memory of one region: a raw allocation we own, or another process's, opened by IPC handle.

    Attributes:
        ptr: Device address (0 once closed).
        size: Bytes.
        device: Device index in this process.
        handle: The allocation's 64-byte IPC handle.
        owned: Whether :meth:`close` frees it (else it closes the IPC mapping).
    """

    ptr: int
    size: int
    device: int
    handle: bytes
    owned: bool

    @classmethod
    def allocate(cls, size: int, device: int) -> DeviceBuffer:
        """A raw ``cudaMalloc`` of ``size`` bytes on ``device`` (never from cupy's memory pool).

        A pooled block may be a piece of a larger allocation; its IPC handle
        exports that whole allocation and the server maps it at its base, so
        every offset would be wrong. The allocation is rounded up to
        :data:`REGION_ALIGN`; ``size`` stays what was asked for.

        Raises:
            CudaUnavailableError / NoGpuError / CudaError.
        """
        cupy = import_cupy()
        device = require_device(device)
        runtime = cupy.cuda.runtime
        padded = -(-size // REGION_ALIGN) * REGION_ALIGN  # a block of our own (see REGION_ALIGN)
        with cupy.cuda.Device(device):
            try:
                ptr = int(runtime.malloc(padded))
            except runtime.CUDARuntimeError as e:
                raise CudaError(f"cudaMalloc of {padded} bytes on GPU {device} failed: {e}") from e
            try:
                runtime.memset(ptr, 0, padded)
                handle = bytes(runtime.ipcGetMemHandle(ptr))
            except runtime.CUDARuntimeError as e:
                runtime.free(ptr)
                raise CudaError(f"no CUDA IPC handle for GPU {device} memory: {e}") from e
        return cls(ptr, size, device, handle, owned=True)

    @classmethod
    def open(cls, handle: bytes, size: int, device: int) -> DeviceBuffer:
        """Map another process's allocation from its IPC handle.

        Raises:
            CudaError: The handle is invalid (its owner freed it or died, or another GPU).
        """
        cupy = import_cupy()
        device = require_device(device)
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            try:
                ptr = int(runtime.ipcOpenMemHandle(bytes(handle)))
            except runtime.CUDARuntimeError as e:
                raise CudaError(f"invalid CUDA IPC handle on GPU {device}: {e}") from e
        return cls(ptr, size, device, bytes(handle), owned=False)

    @property
    def handle_b64(self) -> bytes:
        return encode_handle(self.handle)

    def as_cupy(self, owner: Any, offset: int = 0, nbytes: int | None = None) -> Any:
        """A flat uint8 cupy array over ``[offset, offset + nbytes)`` that keeps ``owner`` alive."""
        cupy = import_cupy()
        nbytes = self.size - offset if nbytes is None else nbytes
        memory = cupy.cuda.UnownedMemory(self.ptr + offset, nbytes, owner, device_id=self.device)
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def close(self) -> None:
        """Free (or unmap) the memory. Idempotent. Callers unregister it from Triton first."""
        if not self.ptr:
            return
        ptr, self.ptr = self.ptr, 0
        cupy = import_cupy()
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(self.device):
            try:
                # Pending work on the region (our copies) must finish before the memory goes.
                runtime.deviceSynchronize()
                if self.owned:
                    runtime.free(ptr)
                else:
                    runtime.ipcCloseMemHandle(ptr)
            except runtime.CUDARuntimeError as e:
                logger.warning("releasing GPU %d memory at %#x failed: %s", self.device, ptr, e)


def is_device_array(value: Any) -> bool:
    """Whether ``value`` lives in CUDA memory (cupy array, torch CUDA tensor, any CUDA DLPack object)."""
    if hasattr(value, "__cuda_array_interface__"):
        return True
    dlpack_device = getattr(value, "__dlpack_device__", None)
    if dlpack_device is None:
        return False
    try:
        kind, _ = dlpack_device()
    except Exception:
        return False
    # DLPack device types: 2 = kDLCUDA, 3 = kDLCUDAHost, 13 = kDLCUDAManaged.
    return int(kind) in (2, 13)


def as_cupy(value: Any) -> Any:
    """A zero-copy cupy view of a CUDA array or DLPack object.

    Raises:
        CudaUnavailableError: cupy is missing.
    """
    cupy = import_cupy()
    if isinstance(value, cupy.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        return cupy.from_dlpack(value)
    return cupy.asarray(value)


def to_host(value: Any) -> Any:
    """``value`` as a numpy array if it is in GPU memory; otherwise unchanged (no cupy import needed)."""
    if is_device_array(value):
        return import_cupy().asnumpy(as_cupy(value))
    return value


def local_device_uuids() -> list[str] | None:
    """UUIDs (``GPU-...``) of this process's GPUs by index, from cupy; ``None`` when unknown."""
    try:
        cupy = import_cupy()
        runtime = cupy.cuda.runtime
        uuids = []
        for index in range(int(runtime.getDeviceCount())):
            raw = bytes(runtime.getDeviceProperties(index)["uuid"])
            if len(raw) != 16:
                return None
            h = raw.hex()
            uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
        return uuids
    except Exception as e:  # cupy missing, no GPU, an old cupy without "uuid"
        logger.debug("GPU UUIDs unknown: %s", e)
        return None
