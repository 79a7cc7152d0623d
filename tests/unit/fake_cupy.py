"""A stand-in for the parts of cupy the CUDA pools use, backed by host memory, for unit tests.

It records what a GPU would be asked to do (allocations, frees, copies, and
on which device and stream each ran) so tests can check the order and the
context of the calls without a GPU. It checks nothing about real CUDA
behaviour; the GPU integration tests (tests/integration/test_cuda.py) do.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import numpy as np

uint8 = np.uint8


class CUDARuntimeError(RuntimeError):
    pass


class _State:
    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.allocations: dict[int, np.ndarray] = {}  # base pointer -> bytes
        self.owner: dict[int, int] = {}  # base pointer -> device
        self.next_ptr = 1 << 32
        self.log: list[tuple[Any, ...]] = []
        self.local = threading.local()

    @property
    def device(self) -> int:
        return getattr(self.local, "device", 0)

    def stream(self) -> Stream:
        streams = self.local.__dict__.setdefault("streams", {})
        return streams.get(self.device) or _null_stream(self.device)

    def find(self, ptr: int) -> tuple[np.ndarray, int, int]:
        for base, block in self.allocations.items():
            if base <= ptr < base + block.size:
                return block, ptr - base, self.owner[base]
        raise CUDARuntimeError(f"no allocation at {ptr:#x}")


STATE = _State(1)
_NULL: dict[int, Stream] = {}


def reset(devices: int = 1) -> _State:
    """A fresh fake GPU state with ``devices`` GPUs; returns it (its ``log`` records the calls)."""
    global STATE
    STATE = _State(devices)
    _NULL.clear()
    return STATE


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = STATE.device if device is None else int(device)
        self._saved: list[int] = []

    def __enter__(self) -> Device:
        self._saved.append(STATE.device)
        STATE.local.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        STATE.local.device = self._saved.pop()


class Stream:
    def __init__(self, non_blocking: bool = False, *, _device: int | None = None) -> None:
        self.device = STATE.device if _device is None else _device
        self.non_blocking = non_blocking
        self.name = "null" if _device is not None else f"stream{id(self) & 0xFFFF:x}"
        self._saved: list[Stream | None] = []

    def wait_event(self, event: Event) -> None:
        STATE.log.append(("wait_event", self.name, event.stream_name, STATE.device))

    def synchronize(self) -> None:
        STATE.log.append(("stream_synchronize", self.name))

    def __enter__(self) -> Stream:
        streams = STATE.local.__dict__.setdefault("streams", {})
        self._saved.append(streams.get(STATE.device))
        streams[STATE.device] = self
        return self

    def __exit__(self, *exc: object) -> None:
        STATE.local.streams[STATE.device] = self._saved.pop()


def _null_stream(device: int) -> Stream:
    if device not in _NULL:
        _NULL[device] = Stream(_device=device)
    return _NULL[device]


def get_current_stream() -> Stream:
    return STATE.stream()


class Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self.stream_name: str | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or STATE.stream()
        self.stream_name = stream.name
        STATE.log.append(("record", stream.name, STATE.device))

    def synchronize(self) -> None:
        STATE.log.append(("event_synchronize", self.stream_name))


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int) -> None:
        self.mem, self.offset = mem, offset


class _Pointer:
    def __init__(self, array: ndarray) -> None:
        self.array = array

    def copy_from_device_async(self, src: _Pointer, size: int, stream: Stream | None = None) -> None:
        name = (stream or STATE.stream()).name
        STATE.log.append(("memcpy", STATE.device, name, size))
        _bytes(self.array)[:size] = _bytes(src.array)[:size]

    def copy_from_device(self, src: _Pointer, size: int) -> None:
        self.copy_from_device_async(src, size, None)


def _bytes(array: ndarray) -> np.ndarray:
    return array._np.reshape(-1).view(np.uint8)


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)


class ndarray:
    """A host numpy array posing as device memory on ``device``; ``_keep`` holds its memory's owner."""

    def __init__(
        self, shape: tuple[int, ...], dtype: Any = np.uint8, memptr: MemoryPointer | None = None
    ) -> None:
        if memptr is None:
            self._np = np.zeros(shape, dtype)
            self._device = STATE.device
            self._keep: Any = None
            return
        block, offset, device = STATE.find(memptr.mem.ptr + memptr.offset)
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._np = block[offset : offset + count].view(dtype).reshape(shape)
        self._device = device if memptr.mem.device_id is None else memptr.mem.device_id
        self._keep = memptr.mem

    @classmethod
    def _wrap(cls, a: np.ndarray, device: int, keep: Any = None) -> ndarray:
        out = cls.__new__(cls)
        out._np, out._device, out._keep = a, device, keep
        return out

    shape = property(lambda self: self._np.shape)
    dtype = property(lambda self: self._np.dtype)
    nbytes = property(lambda self: self._np.nbytes)
    size = property(lambda self: self._np.size)
    ndim = property(lambda self: self._np.ndim)
    flags = property(lambda self: _Flags(self._np))
    data = property(lambda self: _Pointer(self))
    device = property(lambda self: Device(self._device))

    def __len__(self) -> int:
        return len(self._np)

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray._wrap(self._np[key], self._device, self._keep)

    def view(self, dtype: Any) -> ndarray:
        return ndarray._wrap(self._np.view(dtype), self._device, self._keep)

    def reshape(self, shape: Any) -> ndarray:
        return ndarray._wrap(self._np.reshape(shape), self._device, self._keep)

    def copy(self) -> ndarray:
        STATE.log.append(("copy", STATE.device, STATE.stream().name, self._device))
        return ndarray._wrap(self._np.copy(), STATE.device)

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        STATE.log.append(("set", STATE.device, (stream or STATE.stream()).name))
        self._np[...] = arr

    def get(self) -> np.ndarray:
        return self._np.copy()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}


def asarray(a: Any) -> ndarray:
    return a if isinstance(a, ndarray) else ndarray._wrap(np.asarray(a).copy(), STATE.device)


def ascontiguousarray(a: ndarray) -> ndarray:
    STATE.log.append(("ascontiguous", STATE.device, STATE.stream().name))
    return ndarray._wrap(np.ascontiguousarray(a._np), STATE.device)


def asnumpy(a: Any) -> np.ndarray:
    return a._np.copy() if isinstance(a, ndarray) else np.asarray(a)


def concatenate(parts: list[ndarray]) -> ndarray:
    STATE.log.append(("concatenate", STATE.device, tuple(p._device for p in parts)))
    return ndarray._wrap(np.concatenate([p._np for p in parts]), STATE.device)


def from_dlpack(value: Any) -> ndarray:
    raise NotImplementedError


class _Runtime:
    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDeviceCount() -> int:
        return STATE.devices

    @staticmethod
    def getDevice() -> int:
        return STATE.device

    @staticmethod
    def getDeviceProperties(index: int) -> dict[str, Any]:
        return {"uuid": bytes([index + 1] * 16)}

    @staticmethod
    def malloc(size: int) -> int:
        ptr = STATE.next_ptr
        STATE.next_ptr += size + (1 << 21)
        STATE.allocations[ptr] = np.zeros(size, np.uint8)
        STATE.owner[ptr] = STATE.device
        STATE.log.append(("malloc", STATE.device, size))
        return ptr

    @staticmethod
    def memset(ptr: int, value: int, size: int) -> None:
        block, offset, _ = STATE.find(ptr)
        block[offset : offset + size] = value

    @staticmethod
    def free(ptr: int) -> None:
        STATE.log.append(("free", STATE.device, ptr))
        del STATE.allocations[ptr]

    @staticmethod
    def ipcGetMemHandle(ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") + bytes(56)

    @staticmethod
    def ipcOpenMemHandle(handle: bytes) -> int:
        return int.from_bytes(handle[:8], "little")

    @staticmethod
    def ipcCloseMemHandle(ptr: int) -> None:
        STATE.log.append(("ipc_close", STATE.device, ptr))

    @staticmethod
    def deviceSynchronize() -> None:
        STATE.log.append(("deviceSynchronize", STATE.device))


cuda = types.SimpleNamespace(
    Device=Device,
    Stream=Stream,
    Event=Event,
    UnownedMemory=UnownedMemory,
    MemoryPointer=MemoryPointer,
    get_current_stream=get_current_stream,
    runtime=_Runtime,
)
