"""glibc's malloc thresholds for the replica's own process, so that large buffers go back when freed.

glibc serves an allocation past its ``mmap_threshold`` with a mapping of its own,
unmapped when freed, and anything smaller from its heaps, which keep freed
memory. As shipped the threshold moves: each mapped block freed raises it to
that block's size (up to 32 MiB), so a replica that decoded large request
bodies once (JSON tensors, buffered gRPC messages) serves the next ones from
its heaps, one per thread, and keeps that memory after the call. A threshold
set once stays put, and so does the trim threshold set with it.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
"""The largest ``mmap_threshold`` glibc takes on a 64-bit machine."""


def set_malloc_thresholds(mmap_threshold: int) -> bool:
    """Fix this process's ``mmap_threshold`` at ``mmap_threshold`` bytes and its trim threshold at twice that.

    Args:
        mmap_threshold: Bytes, 1 to :data:`MAX_MMAP_THRESHOLD`; 0 leaves glibc's own.

    Returns:
        Whether glibc took both (``False``: 0 given, or not glibc's malloc; logged).

    Raises:
        ValueError: ``mmap_threshold`` is out of range.
    """
    if isinstance(mmap_threshold, bool) or not isinstance(mmap_threshold, int):
        raise ValueError(f"mmap_threshold must be an integer, not {mmap_threshold!r}")
    if not 0 <= mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold must be in 0..{MAX_MMAP_THRESHOLD}, not {mmap_threshold}")
    if not mmap_threshold:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no mallopt in this process (not glibc): malloc's thresholds left as they are")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold)
    )
    if not taken:
        logger.warning("glibc refused malloc thresholds of %d bytes: left as they are", mmap_threshold)
    return taken
