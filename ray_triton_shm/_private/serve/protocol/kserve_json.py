"""KServe v2 JSON tensors without a Python object per number: the C reader and writer, and their fallbacks.

A JSON tensor of a million numbers costs the json module a million Python
objects (about 32 MB) to read and as many to write. The C extension
``_kserve_json`` reads a request's ``data`` arrays of plain numbers into one
flat buffer (:class:`JsonNumbers`) and writes a numeric output's JSON text
straight from its array. Both give exactly what the json module gives:
where the C reader cannot be sure (escapes, duplicate keys, numbers past a
double, any error), it hands the text back and the json module decides, and
where :meth:`JsonNumbers.tensor` cannot convert exactly as numpy converts a
list, it raises :class:`SlowPath` so that the request is decoded the json
module's way. Without the extension (no C compiler at install time) every
call takes the json module's way.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

try:
    from ray_triton_shm._private.serve.protocol import _kserve_json
except ImportError:  # built without a C compiler: the json module does it all
    _kserve_json = None

_EXACT_INT = 2**53
"""Integers of up to this magnitude convert to a double exactly."""
_NOT_PARSED = object()


class SlowPath(Exception):
    """The fast reading of a request cannot give the json module's answer: decode it that way."""


class JsonNumbers:
    """A JSON array of plain numbers, read into one buffer of int64 (``kind`` ``q``) or float64 (``d``).

    Args:
        buffer: The values, native byte order.
        kind: ``q`` when every element was an integer literal, else ``d``.
    """

    __slots__ = ("buffer", "kind")

    def __init__(self, buffer: bytearray, kind: str) -> None:
        self.buffer = buffer
        self.kind = kind

    def tensor(self, dtype: np.dtype) -> np.ndarray:
        """The flat array of these numbers as ``dtype``, exactly as ``np.asarray(list, dtype)`` gives it.

        Raises:
            SlowPath: Not exactly: booleans or strings wanted, a float for an integer
                type, an integer out of the type's range, or an integer past 2**53
                for a float type. The json module's way then answers (or refuses).
        """
        values = np.frombuffer(self.buffer, dtype=np.int64 if self.kind == "q" else np.float64)
        kind = dtype.kind
        if kind in "iu":
            if self.kind != "q":
                raise SlowPath()
            if values.size:
                info = np.iinfo(dtype)
                if int(values.min()) < info.min or int(values.max()) > info.max:
                    raise SlowPath()
        elif kind == "f":
            if self.kind == "q" and values.size and int(np.abs(values).max()) > _EXACT_INT:
                raise SlowPath()
        else:
            raise SlowPath()
        return values if values.dtype == dtype else values.astype(dtype)


def loads_numbers(text: bytes | bytearray) -> Any:
    """The JSON document of ``text`` with its ``data`` arrays of numbers as :class:`JsonNumbers`.

    Returns:
        The document, or ``None`` when the json module must read it (no C reader,
        or text the C reader leaves to it).
    """
    if _kserve_json is None:
        return None
    value = _kserve_json.loads(text, JsonNumbers, _NOT_PARSED)
    return None if value is _NOT_PARSED else value


def numbers_json(array: np.ndarray) -> bytes | None:
    """``json.dumps(array.ravel().tolist()).encode()`` of a numeric or boolean array.

    Returns:
        The text, or ``None`` when only the json module writes it (no C writer, or
        a dtype it does not write).
    """
    if _kserve_json is None or array.dtype == object:
        return None
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype == np.float16:  # as tolist() does: each half widened to a Python float
        flat = flat.astype(np.float64)
    if not flat.dtype.isnative:
        flat = flat.astype(flat.dtype.newbyteorder("="))
    try:
        return _kserve_json.dumps_numbers(memoryview(flat))
    except TypeError:
        return None


class RawJson:
    """JSON text to be written as it is by :func:`dumps` (an output's numbers from :func:`numbers_json`).

    Args:
        text: The text (held, not copied).
    """

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


def dumps(value: Any) -> bytes:
    """``json.dumps(value).encode()``, with every :class:`RawJson` in ``value`` written as it is.

    Dicts and lists are written with ``json.dumps``'s default separators, so
    that the text is the json module's own, byte for byte; the pieces are
    joined once, so a large :class:`RawJson` is copied once.
    """
    parts: list[bytes] = []
    _dump_into(value, parts)
    return b"".join(parts)


def _dump_into(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, RawJson):
        parts.append(value.text)
    elif isinstance(value, dict):
        parts.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            parts.append((", " if i else "").encode() + json.dumps(key).encode() + b": ")
            _dump_into(item, parts)
        parts.append(b"}")
    elif isinstance(value, list):
        parts.append(b"[")
        for i, item in enumerate(value):
            if i:
                parts.append(b", ")
            _dump_into(item, parts)
        parts.append(b"]")
    else:
        parts.append(json.dumps(value).encode())


def available() -> bool:
    """Whether the C reader and writer are built."""
    return _kserve_json is not None
