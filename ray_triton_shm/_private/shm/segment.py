"""POSIX shared-memory segments under /dev/shm, owned or attached, and their names.

Segments are created exclusively with mode 0600, and their space is reserved up
front (so a full /dev/shm fails here with a clear error instead of a SIGBUS
later). A name carries its owner's pid and start time (:func:`new_segment_name`)
and is validated before any use.

An owner keeps an exclusive ``flock`` on its segment for the segment's whole
life, and lets go of it only after unlinking the name: a held lock tells a
sweeper, in any pid namespace sharing /dev/shm, that the owner lives (the sweep
of segments whose owner is gone is :mod:`ray_triton_shm._private.shm.sweep`).

``multiprocessing.shared_memory`` is deliberately not used: before Python
3.13 its resource tracker unlinks segments that a process merely attached to.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ray_triton_shm.errors import SharedMemoryError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rtshm"
# Names the Python backend or Triton itself use; ours must never collide.
_RESERVED_PREFIXES = ("triton_python_backend", "triton_")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_NAME_LEN = 200
# Triton's shm offsets and sizes are uint64 on the wire, but a span past int64 is never a real mapping.
_MAX_SPAN = (1 << 63) - 1
_KEY_RE = re.compile(rf"/?{SEGMENT_PREFIX}_[A-Za-z0-9_.-]+")
# How long create() waits for a sweeper that holds the lock of a file it just made
# (a sweeper holds it only between its flock and its unlink).
_LOCK_WAIT_S = 5.0
_CREATE_ATTEMPTS = 3

# Lock fds of segments this process owns. After a fork the child shares their open
# file descriptions (and so the locks): it closes its copies, so that the lock
# follows the owner alone and a segment is not kept alive by a forked child.
_lock_fds: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None if it is gone.

    A zombie counts as gone: it holds nothing, and one whose parent died without
    reaping it (a removed Ray node's workers, in a container whose init does not
    reap) can stay a zombie for good.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def owner_tag(pid: int | None = None) -> str:
    """``<prefix>_<pid>_<start time>`` for ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{SEGMENT_PREFIX}_{pid}_{process_start_time(pid) or 0}"


def new_segment_name(kind: str) -> str:
    """A fresh, unguessable segment name owned by this process.

    Args:
        kind: A short word saying what the segment is for (e.g. ``pool``).

    Returns:
        ``rtshm_<pid>_<start time>_<kind>_<128 random bits>``.
    """
    name = f"{owner_tag()}_{kind}_{secrets.token_hex(16)}"
    validate_segment_name(name)
    return name


def validate_segment_name(name: str) -> None:
    """Refuse names that are empty, contain '/', are reserved, or are too long.

    Args:
        name: A segment name without the leading '/'.

    Raises:
        SharedMemoryError: The name is not acceptable.
    """
    if not isinstance(name, str) or not name:
        raise SharedMemoryError(f"invalid segment name {name!r}: empty")
    if len(name) > MAX_NAME_LEN:
        raise SharedMemoryError(f"invalid segment name: longer than {MAX_NAME_LEN} characters")
    if "/" in name or name in (".", ".."):
        raise SharedMemoryError(f"invalid segment name {name!r}: may not contain '/' or be '.'/'..'")
    if not _NAME_RE.match(name):
        raise SharedMemoryError(f"invalid segment name {name!r}: use letters, digits, '_', '.', '-' only")
    if any(name.startswith(p) for p in _RESERVED_PREFIXES):
        raise SharedMemoryError(f"invalid segment name {name!r}: prefix reserved by Triton")


def check_span(name: str, size: int, offset: int, nbytes: int) -> None:
    """Refuse a byte span that does not lie inside a region of ``size`` bytes.

    Checked before anything is sent to Triton, which would refuse such spans
    itself, but with a message naming the segment key (see :func:`redact`).

    Args:
        name: Region name, for the message.
        size: Bytes in the region.
        offset: First byte of the span.
        nbytes: Length of the span.

    Raises:
        SharedMemoryError: Negative, overflowing or out-of-range values.
    """
    values = (size, offset, nbytes)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise SharedMemoryError(f"region {name!r}: offset and size must be ints, got {values!r}")
    if size <= 0 or offset < 0 or nbytes < 0 or max(values) > _MAX_SPAN:
        raise SharedMemoryError(
            f"region {name!r}: offset {offset} and size {nbytes} must be >= 0 and < 2**63 "
            f"(region size {size})"
        )
    if offset + nbytes > size:
        raise SharedMemoryError(
            f"region {name!r}: bytes {offset}..{offset + nbytes} run past its end ({size} bytes)"
        )


def redact(text: str) -> str:
    """``text`` with our segment keys and region names replaced by ``<shm>``.

    Segment names carry 128 random bits; whoever learns one can attach or
    register it, so they stay out of messages that may leave the machine.
    """
    return _KEY_RE.sub("<shm>", text)


def segment_path(name: str) -> str:
    """The file of segment ``name`` (under :data:`SHM_DIR`)."""
    return os.path.join(SHM_DIR, name)


@dataclass
class Segment:
    """A mapped shared-memory segment.

    Create one with :meth:`create` (owner: holds the segment's ``flock`` until
    close, then unlinks and lets go of it) or :meth:`attach` (never locks, never
    unlinks). ``key`` is what Triton's ``register_system_shared_memory`` expects.
    """

    name: str
    size: int
    mm: mmap.mmap
    owner: bool
    _closed: bool = False
    # An owned segment keeps an fd holding its flock until close(); -1 when attached.
    _lock_fd: int = field(default=-1, repr=False)
    _lock_pid: int = field(default=0, repr=False)

    @property
    def key(self) -> str:
        return "/" + self.name

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create, lock, reserve and map a new segment.

        The returned segment holds the exclusive ``flock`` that tells sweepers, in
        any pid namespace sharing /dev/shm, that its owner is alive.

        Args:
            name: Segment name (validated).
            size: Bytes to reserve; > 0.

        Returns:
            The owning segment.

        Raises:
            SharedMemoryError: The name exists, /dev/shm is too small, the new
                file was swept away or its lock held elsewhere every time, or
                the system refused.
        """
        validate_segment_name(name)
        if size <= 0:
            raise SharedMemoryError(f"segment size must be > 0, got {size}")
        fd = _create_locked(name)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    free = _free_shm_bytes()
                    raise SharedMemoryError(
                        f"/dev/shm has too little space for a {size} byte segment "
                        f"({free} bytes free); enlarge it (docker: --shm-size or "
                        f"--ipc=host) or use fewer/smaller slots"
                    ) from e
                raise SharedMemoryError(f"cannot reserve {size} bytes for {name!r}: {e}") from e
            mm = _map_apart(fd, name, size)
        except BaseException:
            unlink_segment(name)  # unlink first, then let go of the lock
            os.close(fd)
            raise
        _lock_fds.add(fd)
        logger.debug("created segment %s (%d bytes)", name, size)
        return cls(name=name, size=size, mm=mm, owner=True, _lock_fd=fd, _lock_pid=os.getpid())

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> Segment:
        """Map an existing segment without taking ownership.

        Args:
            name: Segment name (validated).
            size: Expected size; checked against the segment if given.

        Returns:
            An attached segment; closing it never unlinks.

        Raises:
            SharedMemoryError: Missing, too small, or not accessible.
        """
        validate_segment_name(name)
        try:
            fd = os.open(segment_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise SharedMemoryError(f"cannot attach segment {name!r}: {e.strerror}") from e
        try:
            actual = os.fstat(fd).st_size
            if size is not None and actual < size:
                raise SharedMemoryError(f"segment {name!r} has {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, actual, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name=name, size=actual, mm=mm, owner=False)

    def close(self, keep: Sequence[tuple[int, int]] = ()) -> None:
        """Unmap, and unlink if owned (by this process: not in a forked child). Idempotent.

        If arrays still point into the mapping it cannot be unmapped now; the
        name is unlinked all the same and the memory is freed when the last
        array goes. Before that, the byte ranges ``keep`` (``(offset, size)``,
        where such arrays may point) are swapped for private copies of
        themselves, so that what those arrays show can no longer change: once
        closed, the shared memory behind them may be handed to another process
        or written by a request still running on the server.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.mm.close()
        except BufferError:
            logger.warning("segment %s still has arrays pointing into it; unmapped later", self.name)
            for offset, size in keep:
                _make_private(self.mm, offset, size)
        # A forked child's copy of an owned segment is not the owner: the name stays the parent's.
        if self.owner and self._lock_pid == os.getpid():
            unlink_segment(self.name)
        # The lock goes only after the name: a sweeper never sees the file linked and unlocked.
        if self._lock_fd >= 0 and self._lock_pid == os.getpid():  # a forked child closed its copy already
            _lock_fds.discard(self._lock_fd)
            os.close(self._lock_fd)
        self._lock_fd = -1


def _create_locked(name: str) -> int:
    """Create ``name`` exclusively and take its owner lock; the fd holding the lock.

    Between the exclusive open and the flock a sweeper in another pid namespace
    (where our pid names no live process) can take the lock of the new, still
    unlocked file and unlink it. We see that as a link count of 0 once we hold
    the lock, and create the name again.
    """
    path = segment_path(name)
    for _ in range(_CREATE_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError as e:
            raise SharedMemoryError(f"segment {name!r} already exists; refusing to reuse it") from e
        except OSError as e:
            raise SharedMemoryError(f"cannot create segment {name!r}: {e.strerror}") from e
        try:
            _lock_within(fd, name, _LOCK_WAIT_S)
            swept = os.fstat(fd).st_nlink == 0
        except BaseException:
            unlink_segment(name)
            os.close(fd)
            raise
        if not swept:
            return fd
        os.close(fd)
        logger.debug("segment %s was swept while being created; creating it again", name)
    raise SharedMemoryError(f"cannot create segment {name!r}: removed by a sweeper {_CREATE_ATTEMPTS} times")


def _map_apart(lock_fd: int, name: str, size: int) -> mmap.mmap:
    """Map the file of ``lock_fd`` through an open file description of its own.

    ``mmap.mmap`` keeps a dup of the fd it is given, and a dup shares the open file
    description, so a mapping made from the lock fd would hold the lock too: in a
    forked child for as long as the child lives, beyond the owner's death.
    """
    try:
        map_fd = os.open(segment_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SharedMemoryError(f"cannot map segment {name!r}: {e.strerror}") from e
    try:
        ours, mapped = os.fstat(lock_fd), os.fstat(map_fd)
        if (ours.st_dev, ours.st_ino) != (mapped.st_dev, mapped.st_ino):
            raise SharedMemoryError(f"segment {name!r} was replaced while being created")
        return mmap.mmap(map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(map_fd)


def _lock_within(fd: int, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SharedMemoryError(
                    f"cannot lock new segment {name!r}: another process held its lock for {timeout_s:g} s"
                ) from None
            time.sleep(0.005)
        except OSError as e:
            raise SharedMemoryError(f"cannot lock new segment {name!r}: {e.strerror}") from e


_PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    size_t, ptr, c_int = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    libc.mmap.argtypes = [ptr, size_t, c_int, c_int, c_int, ctypes.c_long]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ptr, size_t, size_t, c_int, ptr]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _make_private(mm: mmap.mmap, offset: int, size: int) -> None:
    """Replace the pages of ``mm`` holding ``[offset, offset + size)`` by a private copy, atomically.

    The copy is made in fresh anonymous memory and moved over the shared pages
    with ``mremap(MREMAP_FIXED)``, so a reader never sees a hole. On failure
    the pages stay shared (logged): the caller's views stay valid memory.
    """
    start = offset - offset % _PAGE
    stop = min(len(mm), -(-(offset + size) // _PAGE) * _PAGE)
    if stop <= start:
        return
    length = stop - start
    anchor = ctypes.c_char.from_buffer(mm)  # only to learn the address; let go below
    try:
        target = ctypes.addressof(anchor) + start
    finally:
        del anchor
    libc = _libc()
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    copy = libc.mmap(None, length, prot, flags, -1, 0)
    if copy in (None, ctypes.c_void_p(-1).value):
        logger.warning("could not copy %d bytes of a closed segment: errno %d", length, ctypes.get_errno())
        return
    ctypes.memmove(copy, target, length)
    moved = libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, target)
    if moved != target:
        logger.warning("could not detach %d bytes of a closed segment: errno %d", length, ctypes.get_errno())
        libc.munmap(copy, length)


def unlink_segment(name: str) -> bool:
    """Remove segment ``name``'s file; whether it was there."""
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        return False
    return True


def _free_shm_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize
