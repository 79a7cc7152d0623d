"""BYTES (STRING) tensors in a slot: Triton's serialised form, written and read in place.

Triton lays a BYTES tensor out as its elements in row-major order, each a
4-byte little-endian length followed by that many bytes. A slot reserves
``4 + PoolConfig.max_element_bytes`` bytes per element for such a tensor.

Example:
    >>> import numpy as np
    >>> region = np.zeros(64, np.uint8)
    >>> items = np.array([b"ab", b""], dtype=object)
    >>> size = serialize_into(region, items)
    >>> size, parse(region[:size], 2).tolist()
    (10, [b'ab', b''])
"""

from __future__ import annotations

import struct

import numpy as np

from ray_triton_shm.errors import InputError, TritonCallError

_LENGTH = struct.Struct("<I")
PREFIX_BYTES = _LENGTH.size


def longest_element(array: np.ndarray) -> int:
    """Length of the longest element of an object array of ``bytes`` (0 when empty)."""
    return max(map(len, array.flat), default=0)


def serialize_into(target: np.ndarray, items: np.ndarray) -> int:
    """Write ``items`` in Triton's serialised BYTES form at the start of ``target``.

    Each element is copied once, straight into ``target``; no joined copy is made.

    Args:
        target: A writable flat ``uint8`` array (a slot's input region).
        items: An array of ``bytes`` (``str`` is encoded as UTF-8), any shape, row-major order.

    Returns:
        The serialised size in bytes.

    Raises:
        InputError: An element is neither ``bytes`` nor ``str``, or the elements
            do not fit ``target`` (callers check sizes first).
    """
    view = memoryview(target).cast("B")
    cursor = 0
    for item in items.flat:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            raise InputError(f"a BYTES tensor takes bytes or str elements, got {type(item).__name__}")
        size = len(item)
        end = cursor + PREFIX_BYTES + size
        if end > len(view):
            raise InputError(f"{end} bytes of BYTES elements do not fit their {len(view)} byte region")
        _LENGTH.pack_into(view, cursor, size)
        view[cursor + PREFIX_BYTES : end] = item
        cursor = end
    return cursor


def parse(source: np.ndarray | memoryview, count: int, model: str | None = None) -> np.ndarray:
    """Read ``count`` serialised BYTES elements from the start of ``source`` (copied out).

    Args:
        source: The bytes Triton wrote (a slot's output region; may be longer).
        count: Elements expected (the product of the output's shape).
        model: For errors.

    Returns:
        A flat object array of ``bytes``.

    Raises:
        TritonCallError: An element's length runs past ``source``: not what
            Triton writes, so the bytes are not trusted.
    """
    view = memoryview(source).cast("B")
    out = np.empty(count, dtype=object)
    cursor = 0
    for index in range(count):
        start = cursor + PREFIX_BYTES
        if start > len(view):
            raise TritonCallError(f"BYTES output ends inside element {index}'s length", None, model)
        (size,) = _LENGTH.unpack_from(view, cursor)
        cursor = start + size
        if cursor > len(view):
            raise TritonCallError(f"BYTES output element {index} runs past its region", None, model)
        out[index] = bytes(view[start:cursor])
    return out


def serialized_size(source: np.ndarray | memoryview, count: int) -> int:
    """The serialised size of the first ``count`` elements in ``source`` (lengths only read)."""
    view = memoryview(source).cast("B")
    cursor = 0
    for _ in range(count):
        if cursor + PREFIX_BYTES > len(view):
            break
        cursor += PREFIX_BYTES + _LENGTH.unpack_from(view, cursor)[0]
    return min(cursor, len(view))
