"""Tensors in the protocol's wire forms, for HTTP and gRPC alike: Triton's serialised BYTES, placeholders.

A BYTES tensor travels as its elements one after another, each a 4-byte
little-endian length and its bytes (the binary-tensor extension over HTTP,
``raw_input_contents`` over gRPC). A placeholder stands for a tensor whose
bytes have not arrived yet: its dtype and shape, with no memory behind it.
"""

from __future__ import annotations

import numpy as np

from ray_triton_shm.errors import InputError


def placeholder(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array of ``shape`` and ``dtype`` with one element's memory behind it (every
    stride 0): what ``np.broadcast_to`` of a scalar gives, at a fraction of its cost."""
    array = np.ndarray(shape, dtype, buffer=np.zeros(1, dtype), strides=(0,) * len(shape))
    array.flags.writeable = False
    return array


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor in Triton's serialised form: per element a 4-byte little-endian length, its bytes."""
    parts = []
    for item in array.flat:
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(data: bytes | memoryview, count: int | None = None) -> np.ndarray:
    """Parse Triton's serialised BYTES form into a flat object array of ``bytes``.

    Args:
        data: The serialised elements.
        count: Elements expected; ``None`` reads to the end of ``data``.

    Raises:
        InputError: A length runs past the data, or the element count is wrong.
    """
    view = memoryview(data)
    items = []
    cursor = 0
    while cursor < len(view) and (count is None or len(items) < count):
        if cursor + 4 > len(view):
            raise InputError("BYTES data ends inside an element's 4-byte length")
        size = int.from_bytes(view[cursor : cursor + 4], "little")
        cursor += 4
        if cursor + size > len(view):
            raise InputError("a BYTES element runs past the end of its data")
        items.append(bytes(view[cursor : cursor + size]))
        cursor += size
    if count is not None and (len(items) != count or cursor != len(view)):
        raise InputError(f"BYTES data does not hold exactly {count} elements")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
