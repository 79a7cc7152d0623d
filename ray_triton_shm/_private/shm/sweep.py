"""The sweep: finding and removing segments whose owner is gone.

A process killed before it closes its segments leaves them in /dev/shm; the
next one to sweep removes them (:func:`sweep_stale_segments`, or a look without
removing: :func:`stale_segments`). Owner liveness holds across pid namespaces:
the owner keeps an exclusive ``flock`` on its segment for the segment's whole
life (see :class:`~ray_triton_shm._private.shm.segment.Segment`), and a sweeper
removes a segment only when it can take that lock itself (no open file
description holds it: the owner is gone, wherever it ran) *and* the owner's pid
and start time, carried in the name, do not name a live process in the
sweeper's ``/proc``. The pid check alone is wrong across containers that share
/dev/shm but not a pid namespace (the pid means another process there, or
none); the lock alone cannot protect segments that were never locked (made by
an older version, or by Triton's Python backend: those are guarded by a lock
holder, see :func:`stale_segments`).

:func:`unlink_with_prefix` removes a server's own files under its prefix, with
no look at their owner.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re

from ray_triton_shm._private.shm.segment import (
    SEGMENT_PREFIX,
    SHM_DIR,
    process_start_time,
    segment_path,
    unlink_segment,
)
from ray_triton_shm.errors import SharedMemoryError

logger = logging.getLogger(__name__)

_OWNED_RE = re.compile(rf"^{SEGMENT_PREFIX}_(\d+)_(\d+)_")


def _owner_alive(pid: int, start: int) -> bool:
    actual = process_start_time(pid)
    return actual is not None and (start == 0 or actual == start)


def _try_lock(name: str) -> int | None:
    """An fd holding the exclusive lock of ``name``, or None if it cannot be had.

    None means "do not touch": the lock is held (a live owner, wherever it runs), or
    the file is gone or not ours to open (another user's file).
    """
    try:
        fd = os.open(segment_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held; anything else: cannot tell, so keep it
        os.close(fd)
        return None
    return fd


def _guard_free(name: str) -> bool:
    """Whether the lock holder ``name`` is gone or unlocked (its owner no longer guards anything)."""
    fd = _try_lock(name)
    if fd is None:
        return not os.path.lexists(segment_path(name))  # removed between the two looks
    os.close(fd)
    return True


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _pid_says_gone(name: str) -> bool:
    m = _OWNED_RE.match(name)
    return bool(m) and not _owner_alive(int(m.group(1)), int(m.group(2)))


def _guards(name: str, names: list[str]) -> list[str]:
    """Lock holders guarding ``name``: every listed ``L`` such that ``name`` starts with ``L + "_"``.

    Triton's Python backend makes its own files under a prefix we choose and never
    locks them; a server holds a locked segment named after that prefix (without its
    last ``_``) for as long as it runs.
    """
    return [other for other in names if name.startswith(other + "_")]


def stale_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Our segments whose owner is gone, as far as a look without removing can tell.

    A segment is stale when its owner's pid and start time (from its name) name no
    live process here, and neither its own lock nor the lock of any segment guarding
    it (see :func:`_guards`) is held. A held lock means a live owner, in this pid
    namespace or another that shares /dev/shm. A segment that was never locked (made
    by an older version) is judged by the pid alone: across pid namespaces
    such segments of a live owner can be taken for stale, so upgrade every container
    sharing /dev/shm together. Only names starting with ``prefix`` are judged.
    """
    names = list_segments()
    return [name for name in names if name.startswith(prefix) and _looks_stale(name, names)]


def _looks_stale(name: str, names: list[str]) -> bool:
    if not _pid_says_gone(name) or not all(_guard_free(g) for g in _guards(name, names)):
        return False
    fd = _try_lock(name)
    if fd is None:
        return False
    os.close(fd)
    return True


def sweep_stale_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink segments left behind by owners that are gone (see :func:`stale_segments`).

    Each one is unlinked while this process holds its lock, and only if its name
    still leads to the file that was locked, so a segment created, closed or swept
    by someone else meanwhile is left alone.

    Args:
        prefix: Only names starting with it (all of ours by default).

    Returns:
        The names removed.
    """
    names = list_segments()
    removed = []
    for name in names:
        if (
            not name.startswith(prefix)
            or not _pid_says_gone(name)
            or not all(_guard_free(g) for g in _guards(name, names))
        ):
            continue
        fd = _try_lock(name)
        if fd is None:
            continue
        try:
            locked = os.fstat(fd)
            current = os.stat(segment_path(name), follow_symlinks=False)
            if (current.st_dev, current.st_ino) == (locked.st_dev, locked.st_ino) and unlink_segment(name):
                removed.append(name)
        except OSError:
            pass  # gone meanwhile, or not ours to remove
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d stale shared-memory segment(s): %s", len(removed), removed)
    return removed


def unlink_with_prefix(prefix: str) -> list[str]:
    """Unlink every /dev/shm entry starting with ``prefix`` (a server's own segments).

    Args:
        prefix: Must start with our project prefix; guards against removing others' files.

    Returns:
        The names removed.
    """
    if not prefix.startswith(SEGMENT_PREFIX + "_"):
        raise SharedMemoryError(f"refusing to unlink outside our prefix: {prefix!r}")
    return [name for name in list_segments(prefix) if unlink_segment(name)]
