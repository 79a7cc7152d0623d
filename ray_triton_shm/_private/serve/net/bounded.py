"""Bodies read or inflated within a byte limit: the error past it, and a bounded ``gzip``/``deflate``."""

from __future__ import annotations

import zlib

from ray_triton_shm.errors import InputError, RequestTooLargeError


def too_large(what: str, max_bytes: int) -> RequestTooLargeError:
    """The error for a body (or what it inflates to) past ``max_bytes``."""
    return RequestTooLargeError(
        f"{what} exceeds the maximum allowed size of {max_bytes} bytes (NodeConfig.max_request_bytes)"
    )


def inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """``data`` inflated from ``encoding`` (``gzip`` or ``deflate``), never past ``max_bytes``.

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
        RequestTooLargeError: It inflates to more than ``max_bytes``.
    """
    if encoding not in ("gzip", "deflate"):
        raise InputError(f"unsupported Content-Encoding {encoding!r}")
    inflator = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    parts: list[bytes] = []
    size = 0
    pending = data
    try:
        while pending and not inflator.eof:
            part = inflator.decompress(pending, max_bytes + 1 - size)
            size += len(part)
            if size > max_bytes:
                raise too_large("decompressed request body", max_bytes)
            parts.append(part)
            pending = inflator.unconsumed_tail
    except zlib.error as e:
        raise InputError(f"request body is not valid {encoding} data: {e}") from e
    if not inflator.eof:
        raise InputError(f"request body is not valid {encoding} data: incomplete or truncated stream")
    return b"".join(parts)
