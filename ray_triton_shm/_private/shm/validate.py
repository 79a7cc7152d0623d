"""Checking inputs against a model layout before any shared memory is touched."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.bytes_tensor import longest_element
from ray_triton_shm._private.shm.cuda import as_cupy, is_device_array, to_host
from ray_triton_shm._private.shm.layout import (
    NUMPY_TO_TRITON,
    TRITON_TO_NUMPY,
    ModelLayout,
    ModelSignature,
    TensorSpec,
)
from ray_triton_shm.errors import InputError


@dataclass(frozen=True)
class CheckedInputs:
    """Inputs that passed validation.

    Attributes:
        arrays: The arrays by name, in the model's input order.
        batch: Batch size (1 for models without batching).
        nbytes: Total input bytes.
        on_device: Whether some array is in GPU memory (a cupy array then).
    """

    arrays: dict[str, Any]
    batch: int
    nbytes: int
    on_device: bool = False


def _describe(dtype: np.dtype) -> str:
    triton = NUMPY_TO_TRITON.get(dtype)
    return f"{triton} ({dtype})" if triton else str(dtype)


def check_inputs(layout: ModelLayout, inputs: Mapping[str, Any]) -> CheckedInputs:
    """Validate names, dtypes, ranks and shapes of ``inputs`` for ``layout``.

    The batch may exceed the slot's capacity (it is split later); every other
    dim must fit the slot.

    Args:
        layout: The model's slot layout.
        inputs: Arrays by input name.

    Returns:
        The checked inputs.

    BYTES inputs take numpy arrays of ``bytes``/``str`` (``object``, ``S`` or
    ``U`` dtypes) and are returned as ``object`` arrays of ``bytes``; whether
    their elements fit the slot is :func:`bytes_overflow`'s question.

    Raises:
        InputError: Not a mapping, unknown or missing names, wrong dtype (strings
            for a numeric tensor, or not bytes/str for a BYTES one), rank or
            shape, inconsistent batch sizes, an empty batch, or a tensor too
            big for a slot.
    """
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    expected = [spec.name for spec in layout.inputs]
    unknown = sorted(set(inputs) - set(expected))
    missing = [name for name in expected if name not in inputs]
    if unknown or missing:
        raise InputError(
            f"model {layout.model!r} takes inputs {expected}; unknown: {unknown}, missing: {missing}"
        )
    arrays: dict[str, Any] = {}
    on_device = False
    batches = set()
    nbytes = 0
    for spec in layout.inputs:
        value = inputs[spec.name]
        if spec.is_bytes:
            if is_device_array(value):
                raise InputError(f"{spec.name}: a BYTES tensor takes host arrays of bytes or str")
            value = as_bytes_array(spec.name, value)
        elif not isinstance(value, np.ndarray):
            if is_device_array(value):
                # Stays on the GPU: a zero-copy cupy view (raises CudaUnavailableError without cupy).
                value = as_cupy(value)
                on_device = True
            elif not hasattr(value, "__array__"):
                raise InputError(
                    f"{spec.name}: expected a numpy, cupy or DLPack array, got {type(value).__name__}"
                )
            else:
                value = np.asarray(value)
        if spec.is_bytes:
            pass  # bytes elements by construction
        elif value.dtype.kind in "OSUV":
            raise InputError(
                f"{spec.name}: {value.dtype} (BYTES/string) data for a {spec.datatype} tensor; "
                "convert it explicitly (no silent casts)"
            )
        elif value.dtype != spec.dtype:
            raise InputError(
                f"{spec.name}: expected dtype {_describe(spec.dtype)}, got {_describe(value.dtype)}; "
                "convert it explicitly (no silent casts)"
            )
        rank = len(spec.dims) + (1 if layout.batched else 0)
        if value.ndim != rank:
            shape_hint = (["batch"] if layout.batched else []) + list(spec.dims)
            raise InputError(f"{spec.name}: expected rank {rank} {shape_hint}, got shape {list(value.shape)}")
        inner = value.shape[1:] if layout.batched else value.shape
        for got, fixed, most in zip(inner, spec.dims, spec.max_dims):
            if fixed >= 0 and got != fixed:
                raise InputError(
                    f"{spec.name}: shape {list(value.shape)} does not match model dims {list(spec.dims)}"
                )
            if got > most:
                raise InputError(
                    f"{spec.name}: shape {list(value.shape)} is too big for a slot "
                    f"(largest configured shape {list(spec.max_dims)}); raise PoolConfig.max_shapes"
                )
        if layout.batched:
            batches.add(value.shape[0])
        arrays[spec.name] = value
        nbytes += bytes_nbytes(value) if spec.is_bytes else value.nbytes
    if len(batches) > 1:
        raise InputError(f"inputs of {layout.model!r} have different batch sizes: {sorted(batches)}")
    batch = batches.pop() if batches else 1
    if batch < 1 or any(a.size == 0 for a in arrays.values()):
        raise InputError(f"inputs of {layout.model!r} are empty")
    return CheckedInputs(arrays=arrays, batch=batch, nbytes=nbytes, on_device=on_device)


def bytes_overflow(layout: ModelLayout, checked: CheckedInputs) -> str | None:
    """Why a BYTES input of ``checked`` does not fit ``layout``'s slots, or ``None`` if all fit.

    An element may be at most ``max_element_bytes`` long (the bound the slot was sized for).
    """
    for spec in layout.inputs:
        if spec.is_bytes:
            longest = longest_element(checked.arrays[spec.name])
            if longest > spec.element_bytes:
                return (
                    f"{spec.name}: an element of {longest} bytes is longer than the "
                    f"{spec.element_bytes} bytes a slot holds per element; raise PoolConfig.max_element_bytes"
                )
    return None


def as_bytes_array(name: str, value: Any) -> np.ndarray:
    """A BYTES tensor as a numpy object array of ``bytes`` (``str`` encoded as UTF-8).

    Raises:
        InputError: An element is neither ``bytes`` nor ``str``.
    """
    array = np.asarray(value)
    if array.dtype.kind == "S":
        return array.astype(object)
    if array.dtype.kind not in "OU":
        raise InputError(f"{name}: a BYTES tensor takes bytes or str elements, got dtype {array.dtype}")
    out = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        if isinstance(item, str):
            out[index] = item.encode("utf-8")
        elif isinstance(item, (bytes, bytearray, memoryview)):
            out[index] = bytes(item)
        else:
            raise InputError(f"{name}: a BYTES tensor takes bytes or str elements, got {type(item).__name__}")
    return out


def bytes_nbytes(array: np.ndarray) -> int:
    """Bytes of a BYTES tensor in Triton's serialised form (4-byte length prefix per element)."""
    return sum(4 + len(item) for item in array.flat)


def check_signature_inputs(signature: ModelSignature, inputs: Mapping[str, Any]) -> CheckedInputs:
    """Validate ``inputs`` against a model's declared tensors, for a call without slots (plain gRPC).

    Names, dtypes, ranks and fixed dims are checked; variable dims take any size.
    BYTES inputs are returned as object arrays of ``bytes``; GPU arrays are copied to host.

    Raises:
        InputError: Not a mapping, unknown or missing names, wrong dtype, rank or
            shape, inconsistent batch sizes, or an empty batch.
    """
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    expected = [spec.name for spec in signature.inputs]
    unknown = sorted(set(inputs) - set(expected))
    missing = [name for name in expected if name not in inputs]
    if unknown or missing:
        raise InputError(
            f"model {signature.model!r} takes inputs {expected}; unknown: {unknown}, missing: {missing}"
        )
    arrays: dict[str, Any] = {}
    batches = set()
    nbytes = 0
    for spec in signature.inputs:
        value = inputs[spec.name]
        if is_device_array(value):
            value = to_host(value)
        elif not hasattr(value, "__array__") and spec.datatype != "BYTES":
            kind = type(value).__name__
            raise InputError(f"{spec.name}: expected a numpy, cupy or DLPack array, got {kind}")
        if spec.datatype == "BYTES":
            value = as_bytes_array(spec.name, value)
            size = bytes_nbytes(value)
        else:
            value = np.asarray(value)
            dtype = TRITON_TO_NUMPY.get(spec.datatype)
            if dtype is None or value.dtype != dtype:
                raise InputError(
                    f"{spec.name}: expected dtype {spec.datatype}, got {_describe(value.dtype)}; "
                    "convert it explicitly (no silent casts)"
                )
            size = value.nbytes
        rank = len(spec.dims) + (1 if signature.batched else 0)
        if value.ndim != rank:
            shape_hint = (["batch"] if signature.batched else []) + list(spec.dims)
            raise InputError(f"{spec.name}: expected rank {rank} {shape_hint}, got shape {list(value.shape)}")
        inner = value.shape[1:] if signature.batched else value.shape
        if any(fixed >= 0 and got != fixed for got, fixed in zip(inner, spec.dims)):
            raise InputError(
                f"{spec.name}: shape {list(value.shape)} does not match model dims {list(spec.dims)}"
            )
        if signature.batched:
            batches.add(value.shape[0])
        arrays[spec.name] = value
        nbytes += size
    if len(batches) > 1:
        raise InputError(f"inputs of {signature.model!r} have different batch sizes: {sorted(batches)}")
    batch = batches.pop() if batches else 1
    if batch < 1 or any(a.size == 0 for a in arrays.values()):
        raise InputError(f"inputs of {signature.model!r} are empty")
    return CheckedInputs(arrays=arrays, batch=batch, nbytes=nbytes)


def check_indices(slot_indices: Iterable[int], layout: ModelLayout, size: int, name: str) -> list[int]:
    """The slot indices of a pool on a region ``name`` of ``size`` bytes, checked to fit in it."""
    indices = list(slot_indices)
    if not indices:
        raise InputError("a pool needs at least one slot")
    if (max(indices) + 1) * layout.slot_bytes > size:
        raise InputError(f"region {name!r} is too small for slots {indices}")
    return indices


def check_shape(spec: TensorSpec, shape: Sequence[int], batched: bool, capacity: int) -> int:
    """Validate ``shape`` against ``spec``; return the element count."""
    shape = tuple(int(d) for d in shape)
    dims = ((capacity,) if batched else ()) + spec.max_dims
    want = ((-1,) if batched else ()) + spec.dims
    if len(shape) != len(dims):
        raise InputError(f"{spec.name}: expected rank {len(dims)} {list(want)}, got shape {list(shape)}")
    for got, fixed, most in zip(shape, want, dims):
        if got < 0 or (fixed >= 0 and got != fixed):
            raise InputError(f"{spec.name}: shape {list(shape)} does not match {list(want)}")
        if got > most:
            raise InputError(
                f"{spec.name}: shape {list(shape)} is too big for the slot (at most {list(dims)})"
            )
    return math.prod(shape)
