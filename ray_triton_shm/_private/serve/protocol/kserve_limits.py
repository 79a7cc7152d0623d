"""The protocol's limits on what a client sends: JSON, shapes; and the bounded version cache.

Shared by every KServe v2 listener (HTTP and gRPC): what they refuse, they
refuse before numpy, a parser or a cache sees it. Limits on bytes (a body's
size, what it inflates to) are the transports' (:mod:`~ray_triton_shm._private.serve.net.bounded`).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

from ray_triton_shm.errors import InputError

MAX_RANK = 64
"""Most dimensions a tensor may have (numpy's limit)."""
MAX_ELEMENTS = (2**63 - 1) // 8
"""Most elements a tensor may count (its non-zero dimensions multiplied), at 8 bytes an element."""
_MAX_DIM = 2**63 - 1  # Triton's dims are int64


def check_shape(name: str, shape: list[int]) -> None:
    """Refuse a shape no tensor can have, before numpy (or a product of its dims) sees it.

    Args:
        name: The input's name, for the message.
        shape: The dims as the request gives them (any integers).

    Raises:
        InputError: More than :data:`MAX_RANK` dims, a negative dim, a dim past
            int64, or more than :data:`MAX_ELEMENTS` elements (counting the
            non-zero dims, as numpy does).
    """
    if len(shape) > MAX_RANK:
        raise InputError(f"input {name!r}: a shape of {len(shape)} dimensions has more than {MAX_RANK}")
    count = 1
    for dim in shape:
        if dim < 0:
            raise InputError(f"input {name!r}: shape {list(shape)} has a negative dimension")
        if dim > _MAX_DIM:
            raise InputError(f"input {name!r}: shape {list(shape)} is too large (a dimension past int64)")
        count *= dim or 1
        if count > MAX_ELEMENTS:
            raise InputError(
                f"input {name!r}: shape {list(shape)} is too large (more than {MAX_ELEMENTS} elements)"
            )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, each key once.

    Triton's parser reads the first of two equal keys, Python's the last: a
    request checked here must not mean something else to Triton.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InputError(f"failed to parse the request JSON buffer: duplicate key {key!r}")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise InputError(f"failed to parse the request JSON buffer: {name} is not valid JSON")


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONGEST_DIGITS = b"0" * 309


def _maybe_past_double(text: bytes) -> bool:
    """Whether ``text`` has a digit before an exponent, or a run of 309+ digits (in C, no regex)."""
    zeros = text.translate(_DIGITS_AS_ZERO)
    return b"0e" in zeros or b"0E" in zeros or _LONGEST_DIGITS in zeros


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # Python reads it as infinity; Triton's parser refuses it
        raise InputError("failed to parse the request JSON buffer: Number too big to be stored in double.")
    return value


def load_json(data: bytes | bytearray | memoryview) -> Any:
    """The JSON document of a request header, parsed as strictly as Triton parses it.

    Raises:
        InputError: Not UTF-8 or not JSON, a key given twice in one object,
            ``NaN`` or ``Infinity``, a number past a double, nesting too deep, a number
            with too many digits.
    """
    try:
        text = (data if isinstance(data, (bytes, bytearray)) else bytes(data)) or b"{}"
        # Only a literal with an exponent or of 309+ digits can pass a double; checking every
        # float costs a Python call each, so it is done only when the text has one of those.
        checked = _finite_float if _maybe_past_double(text) else float
        return json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=checked
        )
    except InputError:
        raise
    except json.JSONDecodeError as e:
        raise InputError(f"failed to parse the request JSON buffer: {e.msg} at {e.pos}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"failed to parse the request JSON buffer: invalid UTF-8 at {e.start}") from e
    except RecursionError as e:
        raise InputError("failed to parse the request JSON buffer: nesting is too deep") from e
    except ValueError as e:  # an integer of more digits than Python converts
        raise InputError("failed to parse the request JSON buffer: a number has too many digits") from e


VERSION_CACHE_SIZE = 64
"""Models whose served version :class:`VersionCache` keeps."""


class VersionCache:
    """The version Triton serves of each model, for a short while, for the last few models asked.

    Least recently used first out; only models Triton knows are put in (the
    caller's choice), so names a client makes up cannot grow it.

    Args:
        size: Models kept.
        ttl_s: How long an entry holds.
    """

    def __init__(self, size: int = VERSION_CACHE_SIZE, ttl_s: float = 10.0) -> None:
        self._size = size
        self._ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Any:
        return iter(list(self._entries))

    def get(self, model: str, now: float) -> str | None:
        """The version cached for ``model`` at time ``now`` (monotonic), or ``None``."""
        entry = self._entries.get(model)
        if entry is None or entry[0] <= now:
            return None
        self._entries.move_to_end(model)
        return entry[1]

    def put(self, model: str, version: str, now: float) -> None:
        """Keep ``version`` of ``model`` from ``now`` for the cache's time to live."""
        self._entries[model] = (now + self._ttl_s, version)
        self._entries.move_to_end(model)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
