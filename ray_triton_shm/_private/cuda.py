"""CUDA plumbing for the CUDA slot pools: the lazy cupy import, device ids, raw allocations.

Nothing here imports cupy at module import time: a CPU-only installation
never needs it, and asking for CUDA memory without it raises
:class:`~ray_triton_shm.errors.CudaUnavailableError` naming the pip extra.

Device ids
----------
``CUDA_VISIBLE_DEVICES`` renumbers GPUs per process: under Ray a task given
physical GPU 3 sees it as device 0. Triton must be told the id *it* sees,
so a client's device index is first turned into the GPU's identity (an entry
of the client's ``CUDA_VISIBLE_DEVICES``, or the index itself when the
variable is unset), then looked up in the server's numbering
(:func:`server_device_id`). Integer entries name GPUs in CUDA's enumeration
order, which is the same for both processes as long as they share
``CUDA_DEVICE_ORDER``; UUID (``GPU-...``) and MIG (``MIG-...``) entries are
compared as identities, and an index can be compared with a UUID only when
the GPUs' UUIDs are known (``physical_uuids``).
"""

from __future__ import annotations

import base64
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ray_triton_shm.errors import CudaError, CudaUnavailableError, DeviceMappingError, NoGpuError

logger = logging.getLogger(__name__)

CUDA_EXTRA = "pip install 'ray-triton-shm[cuda]'"
IPC_HANDLE_BYTES = 64
REGION_ALIGN = 2 << 20
"""Device regions are allocated in whole multiples of this (2 MiB).

The driver sub-allocates smaller ``cudaMalloc`` requests from shared 2 MiB
blocks, and an IPC handle exports the whole block: a region that shares one
would hand Triton our neighbouring allocations too.
"""
ALL_DEVICES = "all"
"""``server_visible_devices`` value meaning the server's ``CUDA_VISIBLE_DEVICES`` is unset."""

_INT_ENTRY = re.compile(r"^\d+$")


def import_cupy() -> ModuleType:
    """Import cupy on first use.

    Returns:
        The ``cupy`` module.

    Raises:
        CudaUnavailableError: cupy is not installed (or fails to import).
    """
    try:
        import cupy
    except ImportError as e:
        raise CudaUnavailableError(
            f"CUDA shared memory needs cupy, which cannot be imported ({e}); install it with "
            f"{CUDA_EXTRA} (cupy-cuda12x) or the cupy build matching your CUDA"
        ) from e
    return cupy


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


# -- device ids -----------------------------------------------------------
def parse_visible_devices(text: str | None) -> tuple[str, ...] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value exposes, in order.

    Follows CUDA: entries are comma separated, and parsing stops at the first
    entry that is not a non-negative index, a ``GPU-`` UUID or a ``MIG-``
    identifier (so ``"0,-1,1"`` exposes only GPU 0, and ``""`` none).
    Indices are normalised (``"01"`` becomes ``"1"``), UUIDs lower-cased.

    Args:
        text: The variable's value; ``None`` when it is unset.

    Returns:
        The entries, or ``None`` when unset (every GPU visible, in CUDA order).
    """
    if text is None:
        return None
    entries: list[str] = []
    for raw in text.split(","):
        entry = raw.strip()
        if _INT_ENTRY.match(entry):
            entries.append(str(int(entry)))
        elif entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
            entries.append(entry[:4].upper() + entry[4:].lower())
        else:
            break
    return tuple(entries)


def _canonical(entry: str, physical_uuids: Sequence[str] | None) -> str:
    """An entry as a full UUID when UUIDs are known and it names a whole GPU; else as it is."""
    if physical_uuids is None or entry.startswith("MIG-"):
        return entry
    uuids = [u.strip()[:4].upper() + u.strip()[4:].lower() for u in physical_uuids]
    if _INT_ENTRY.match(entry):
        index = int(entry)
        if index >= len(uuids):
            raise DeviceMappingError(f"GPU index {index} does not exist (the node has {len(uuids)} GPUs)")
        return uuids[index]
    # CUDA accepts any unique prefix of a UUID.
    matches = [u for u in uuids if u.startswith(entry)]
    if len(matches) != 1:
        raise DeviceMappingError(f"{entry!r} matches {len(matches)} of the node's GPUs {uuids}")
    return matches[0]


def server_device_id(
    client_index: int,
    client_visible: str | None,
    server_visible: str | None,
    *,
    physical_uuids: Sequence[str] | None = None,
) -> int:
    """The id Triton uses for the GPU a client calls ``client_index``.

    Args:
        client_index: Device index in the client process (after its renumbering).
        client_visible: The client's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        server_visible: The server's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        physical_uuids: UUIDs of the node's GPUs in CUDA order, when known; needed
            only to compare an index with a UUID.

    Returns:
        The device index in the server process.

    Raises:
        DeviceMappingError: The index is negative or not visible to the client,
            the server does not see that GPU, or index and UUID forms meet
            without ``physical_uuids``.
    """
    if isinstance(client_index, bool) or not isinstance(client_index, int) or client_index < 0:
        raise DeviceMappingError(f"client device index must be an int >= 0, got {client_index!r}")
    client = parse_visible_devices(client_visible)
    if client is None:
        identity = str(client_index)
    elif client_index < len(client):
        identity = client[client_index]
    else:
        raise DeviceMappingError(
            f"client device {client_index} is not visible: CUDA_VISIBLE_DEVICES={client_visible!r} "
            f"exposes {len(client)} GPU(s)"
        )
    server = parse_visible_devices(server_visible)
    want = _canonical(identity, physical_uuids)
    if server is None:
        if _INT_ENTRY.match(want):
            return int(want)
        if physical_uuids is not None and not want.startswith("MIG-"):
            return [_canonical(u, physical_uuids) for u in physical_uuids].index(want)
        raise DeviceMappingError(
            f"the client's GPU is {identity!r} and the server's CUDA_VISIBLE_DEVICES is unset: "
            "its index cannot be known without the node's GPU UUIDs"
            + ("" if not want.startswith("MIG-") else " (and a MIG device must be named to the server)")
        )
    candidates = [_canonical(entry, physical_uuids) for entry in server]
    if want in candidates:
        return candidates.index(want)
    if want.startswith("GPU-"):
        # CUDA takes any unique UUID prefix, so one side may name the GPU by a prefix of the other's.
        same = [
            i
            for i, c in enumerate(candidates)
            if c.startswith("GPU-") and (c.startswith(want) or want.startswith(c))
        ]
        if len(same) == 1:
            return same[0]
    kinds = {_INT_ENTRY.match(e) is not None for e in (want, *candidates)}
    hint = " (index and UUID forms cannot be compared without the GPU UUIDs)" if len(kinds) > 1 else ""
    raise DeviceMappingError(
        f"the client's GPU {identity!r} is not visible to the server "
        f"(server CUDA_VISIBLE_DEVICES={server_visible!r}){hint}"
    )


def local_device_index(
    server_device: int,
    local_visible: str | None,
    server_visible: str | None,
    local_count: int,
    *,
    local_uuids: Sequence[str] | None = None,
) -> int:
    """This process's index of the GPU the server calls ``server_device``.

    Every local index is tried in turn: an index the server cannot see (or
    that cannot be compared) is skipped rather than ending the search, so a
    server that sees only GPU 1 is still found at local index 1.

    Args:
        server_device: The GPU in the server's numbering.
        local_visible: This process's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        server_visible: The server's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        local_count: How many GPUs this process sees.
        local_uuids: The UUIDs of this process's GPUs by local index, when
            known (:func:`local_device_uuids`): they let an index on one side
            be matched with a UUID on the other.

    Returns:
        The local device index.

    Raises:
        DeviceMappingError: No local GPU is the server's ``server_device``.
    """
    uuids = list(local_uuids) if local_uuids is not None and len(local_uuids) == local_count else None
    # Unset locally, the local GPUs are all of the node's GPUs in CUDA order.
    physical = uuids if uuids is not None and parse_visible_devices(local_visible) is None else None
    server = parse_visible_devices(server_visible)
    target = None if server is None or not 0 <= server_device < len(server) else server[server_device]
    reasons: list[str] = []
    for index in range(local_count):
        if uuids is not None and target is not None and target.startswith("GPU-"):
            if _canonical(uuids[index], None).startswith(target):
                return index
        try:
            if (
                server_device_id(index, local_visible, server_visible, physical_uuids=physical)
                == server_device
            ):
                return index
        except DeviceMappingError as e:
            reasons.append(f"local GPU {index}: {e}")
    raise DeviceMappingError(
        f"the server's GPU {server_device} is none of this process's {local_count} GPU(s) "
        f"(local CUDA_VISIBLE_DEVICES={local_visible!r}, server's {server_visible!r})"
        + (f"; {'; '.join(reasons)}" if reasons else "")
    )


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


_UNKNOWN = object()


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of TCP sockets listening on ``port`` (any address), from /proc/net."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def detect_server_visible(url: str) -> str | object | None:
    """The ``CUDA_VISIBLE_DEVICES`` of the local process listening on ``url``'s port.

    Reads the listener's environment from ``/proc`` (possible for a server
    of the same user, or as root, in the same PID namespace: not for a
    server in another container).

    Args:
        url: ``host:port`` of the server.

    Returns:
        The value, ``None`` when the server's variable is unset, or the
        sentinel ``_UNKNOWN`` when the server process cannot be found or read.
    """
    try:
        port = int(url.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return _UNKNOWN
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not sockets:
        return _UNKNOWN
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            links = {os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)}
        except OSError:
            continue
        if not links & sockets:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            return _UNKNOWN
        for entry in entries:
            name, _, value = entry.partition(b"=")
            if name == b"CUDA_VISIBLE_DEVICES":
                return value.decode(errors="replace")
        return None
    return _UNKNOWN


def server_visible_devices_of(setting: str | None, url: str) -> str | None:
    """The server's ``CUDA_VISIBLE_DEVICES`` for a direct client (``ClientConfig.server_visible_devices``).

    Args:
        setting: :data:`ALL_DEVICES`: the server's is unset; another string:
            its value; ``None``: read it from the server process
            (:func:`detect_server_visible`).
        url: The server's ``host:port``.

    Raises:
        DeviceMappingError: ``setting`` is ``None`` and the server's
            environment cannot be read. Assuming the client's own would name
            the wrong GPU whenever the two differ (a Ray worker given GPU 3
            sees it as its device 0, a server that sees all GPUs calls it 3).
    """
    if setting == ALL_DEVICES:
        return None
    if setting is not None:
        return setting
    found = detect_server_visible(url)
    if found is _UNKNOWN:
        raise DeviceMappingError(
            f"cannot tell which GPUs the server at {url} sees (its process environment is not "
            "readable from here): set ClientConfig.server_visible_devices (env "
            "RAY_TRITON_SHM_SERVER_VISIBLE_DEVICES) to its CUDA_VISIBLE_DEVICES, or 'all' if unset"
        )
    return found  # type: ignore[return-value]


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
