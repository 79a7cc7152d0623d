"""Who uses which slot of a shared pool, decided between processes by the kernel.

Every process on a node that uses a model's pool maps the same data region
and one small *slot table* segment next to it. A process may use slot ``i``
while it holds an open-file-description lock (``F_OFD_SETLK``) on byte ``i``
of the table's file: the kernel hands each slot to one process at a time, and
drops the lock when that process dies, whatever pid namespace it lives in. So
a process waits only for slots in use, never for slots another process keeps
idle.

The table also says, per slot, until when it is protected after its last
user let go::

    word 0          magic and version (the retired magic once the pool's owner retired it)
    word 1          quarantine in ns: the margin past a request's deadline
    word 2 + i      slot i: 0 free, < 0 leased, > 0 protected until CLOCK_MONOTONIC ns
    word 2 + n + i  slot i's request deadline (CLOCK_MONOTONIC ns) while its lease has a
                    request on the server; 0 when it has none (or no deadline)

A leased slot's word is its lease token, ``-(pid << 32 | nonce)``: the
leasing process's pid and a random nonce drawn for this lease. Another process
on the node can so check that a slot is still held by the lease a slot
reference names (see :mod:`.slot_ref`); -1 (no token) also means leased.

A process that ends a lease normally writes 0 before it unlocks. One whose
request timed out (Triton may still write the outputs) writes a deadline. A
process that dies while leasing leaves its token (< 0) behind: the next process to lock
that slot sees it and starts the quarantine itself. CLOCK_MONOTONIC is one
clock for the whole machine, containers included.

A process waiting for a slot holds a shared lock (``F_RDLCK``) on byte ``n`` of the
table's file, past the slots' bytes: another process asks the kernel whether anyone
else holds one there to know that callers elsewhere wait (and a process that dies
drops its lock), so a slot held for a slow client is let go sooner for them too.

The quarantine is a margin past the deadline of the last request that ran on
the slot: a slot is never handed out again before that deadline plus the
quarantine. A user that timed out is past its deadline already; one that died
with a request on the server (its deadline word is set) may have sent it just
before, so its slot is protected until that request's deadline plus the
quarantine. A lease that died with no request on the server (or one without a
deadline) is protected for the quarantine from when its death is seen.

A forked child inherits its parent's descriptor of the table, and so its
open file description: locks taken through it would not exclude the parent
(the kernel sees one owner). Each table therefore takes a fresh description
in the child right after ``fork()`` and forgets the parent's leases; the
parent's locks stay with the parent alone.

Example:
    >>> table = SlotTable.create(new_segment_name("slots"), slots=4, quarantine_s=30.0)
    >>> user = SlotTable.attach(table.name)
    >>> user.try_claim(0)
    True
    >>> user.release(0)
    >>> user.close(); table.close()
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import struct
import threading
import time
import weakref
from collections.abc import Iterable

from ray_triton_shm._private.shm.segment import Segment
from ray_triton_shm.errors import SharedMemoryError

MAGIC = 0x52545348_4D000002  # "RTSHM" + format 2
# Written over MAGIC by the pool's owner when the pool is retired (its model was reloaded with
# another configuration): users take no more slots of it and ask the owner for the new pool.
RETIRED = 0x52545348_4D0002FF
_WORD = struct.Struct("<q")
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid
FREE, LEASED = 0, -1
# Lease nonces: seeded from the OS once, then drawn without a system call under the pool's lock.
# A forked child continues its parent's sequence, but its tokens carry its own pid.
_NONCES = random.Random()


def lease_token(pid: int, nonce: int) -> int:
    """The slot word of a lease by ``pid`` (22 bits on Linux) with ``nonce`` (31 bits, not 0)."""
    return -(((pid & 0x3FFFFF) << 32) | (nonce & 0x7FFFFFFF))


def token_pid(token: int) -> int:
    """The pid a lease token was written by (see :func:`lease_token`)."""
    return (-token) >> 32


def _flock(kind: int, index: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, index, 1, 0)


# Every table of this process, and the descriptors that hold slots of closed tables (see
# SlotTable.close): after a fork the child gets descriptions of its own and drops these copies.
_tables: weakref.WeakSet[SlotTable] = weakref.WeakSet()
_kept_fds: set[int] = set()
_kept_lock = threading.Lock()


def _after_fork_in_child() -> None:
    for fd in _kept_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _kept_fds.clear()
    for table in list(_tables):
        table._leave_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


def close_kept(fd: int) -> None:
    """Close a descriptor :meth:`SlotTable.close` returned, once its kept slots are free.

    A no-op in a forked child, which never had those locks (and whose copy is closed already).
    """
    with _kept_lock:
        if fd not in _kept_fds:
            return
        _kept_fds.discard(fd)
    os.close(fd)


class SlotTable:
    """The slot table of one pool, as seen by one process (see the module docstring).

    Create one with :meth:`create` (the pool's owner) or :meth:`attach` (its users).
    Every method but :meth:`close` is called under the owning pool's lock.
    """

    def __init__(self, segment: Segment, fd: int) -> None:
        self.segment = segment
        self.name = segment.name
        self._fd = fd
        self._view = memoryview(segment.mm)
        self.slots = (segment.size // _WORD.size - 2) // 2
        self._held: dict[int, int] = {}  # slot -> the token this process wrote for its lease
        self._pid = os.getpid()
        _tables.add(self)

    @classmethod
    def create(cls, name: str, *, slots: int, quarantine_s: float) -> SlotTable:
        """A new table of ``slots`` free slots.

        Raises:
            SharedMemoryError: The segment could not be created.
        """
        segment = Segment.create(name, (2 * slots + 2) * _WORD.size)
        _WORD.pack_into(segment.mm, 8, int(quarantine_s * 1e9))
        _WORD.pack_into(segment.mm, 0, MAGIC)
        return cls(segment, cls._open(name))

    @classmethod
    def attach(cls, name: str) -> SlotTable:
        """Map the table ``name`` made by the pool's owner.

        Raises:
            SharedMemoryError: Missing, or not a slot table.
        """
        segment = Segment.attach(name)
        try:
            magic = _WORD.unpack_from(segment.mm, 0)[0] if segment.size >= 2 * _WORD.size else 0
            if magic not in (MAGIC, RETIRED):
                raise SharedMemoryError(f"segment {name!r} is not a slot table")
            return cls(segment, cls._open(name))
        except BaseException:
            segment.close()
            raise

    @staticmethod
    def _open(name: str) -> int:
        try:
            return os.open(os.path.join("/dev/shm", name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SharedMemoryError(f"cannot open slot table {name!r}: {e.strerror}") from e

    def _leave_parent(self) -> None:
        """In a forked child: a description of our own; the parent's leases stay the parent's."""
        inherited, self._fd = self._fd, -1
        self._held.clear()
        self._pid = os.getpid()
        if inherited < 0:
            return
        try:
            # Through /proc: a new description of the very file, even if its name is gone.
            self._fd = os.open(f"/proc/self/fd/{inherited}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            pass  # no table here: this child claims nothing (see _check_pid)
        finally:
            os.close(inherited)

    def _check_pid(self) -> None:
        """Refuse to act through a description shared with a parent (a fork the hook missed)."""
        if self._pid != os.getpid():
            self._leave_parent()
        if self._fd < 0:
            raise SharedMemoryError(f"slot table {self.name!r} is closed")

    @property
    def quarantine_ns(self) -> int:
        return _WORD.unpack_from(self._view, 8)[0]

    @property
    def retired(self) -> bool:
        """Whether the pool's owner retired this pool (see :meth:`retire`)."""
        return _WORD.unpack_from(self._view, 0)[0] == RETIRED

    def retire(self) -> None:
        """Mark the pool retired: its users take no more slots of it (the owner's call)."""
        _WORD.pack_into(self._view, 0, RETIRED)

    def _word(self, index: int) -> int:
        return _WORD.unpack_from(self._view, 16 + 8 * index)[0]

    def _set(self, index: int, value: int) -> None:
        _WORD.pack_into(self._view, 16 + 8 * index, value)

    def _deadline(self, index: int) -> int:
        return _WORD.unpack_from(self._view, 16 + 8 * (self.slots + index))[0]

    def _set_deadline(self, index: int, value: int) -> None:
        _WORD.pack_into(self._view, 16 + 8 * (self.slots + index), value)

    def _dead_lease_until(self, index: int, now: int) -> int:
        """Until when the slot of a lease that died is protected (see the module docstring)."""
        return max(now, self._deadline(index)) + self.quarantine_ns

    def request_started(self, index: int, timeout_s: float | None) -> None:
        """Say that this process's lease of slot ``index`` has a request on the server now.

        Args:
            index: A slot this process holds (others are left alone).
            timeout_s: The request's deadline from now; None: it has none.
        """
        if index in self._held:
            self._set_deadline(index, time.monotonic_ns() + int(timeout_s * 1e9) if timeout_s else 0)

    def request_ended(self, index: int) -> None:
        """Say that the request on this process's slot ``index`` is over (answered or refused).

        Nothing to say once another thread has closed the table meanwhile: ``close``
        left the slot for the next user to quarantine.
        """
        if index in self._held:
            try:
                self._set_deadline(index, 0)
            except (ValueError, TypeError):  # the view was released under us
                if self._fd >= 0:
                    raise

    def _lock(self, index: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, index))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _locked_elsewhere(self, index: int) -> bool:
        self._check_pid()
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, index))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    def _unlock(self, index: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, index))

    def set_waiting(self, waiting: bool) -> None:
        """Show the other processes that this one waits for a slot, or stop showing it.

        Raises:
            SharedMemoryError: The table is closed in this process.
        """
        self._check_pid()
        kind = fcntl.F_RDLCK if waiting else fcntl.F_UNLCK
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _flock(kind, self.slots))

    def others_waiting(self) -> bool:
        """Whether another process waits for a slot now (see :meth:`set_waiting`).

        Raises:
            SharedMemoryError: The table is closed in this process.
        """
        return self._locked_elsewhere(self.slots)

    def try_claim(self, index: int) -> bool:
        """Take slot ``index`` for this process if nobody uses it and it is not protected.

        Raises:
            SharedMemoryError: The table is closed in this process.
        """
        self._check_pid()
        if not self._lock(index):
            return False
        state, now = self._word(index), time.monotonic_ns()
        if state < 0:  # its last user died while leasing: a request may still be running
            self._set(index, self._dead_lease_until(index, now))
            self._set_deadline(index, 0)
        elif state <= now:
            token = lease_token(os.getpid(), _NONCES.getrandbits(31) | 1)
            self._set(index, token)
            self._held[index] = token
            return True
        self._unlock(index)
        return False

    def release(self, index: int, protect_until_ns: int = FREE) -> None:
        """Give slot ``index`` back, protected until ``protect_until_ns`` (monotonic ns) if given.

        A slot this process does not hold (a forked child's copy of its parent's lease) is left alone.
        """
        if self._pid != os.getpid():
            self._leave_parent()
        if self._held.pop(index, None) is None:
            return
        self._set_deadline(index, 0)
        self._set(index, protect_until_ns)
        self._unlock(index)

    def token(self, index: int) -> int | None:
        """The token of this process's lease of slot ``index``, or None if it does not hold it."""
        return self._held.get(index)

    def held_elsewhere_by(self, index: int, token: int) -> bool:
        """Whether another process holds slot ``index`` right now under the lease ``token``.

        True only while the slot's lock is held (by another open file
        description than this process's) and its word is still ``token``: a
        lease that ended, or a slot someone else leased since, reads False.

        The word is read again after the lock is seen: a lease that ended and a
        new one that took the slot between the first read and the lock check
        would otherwise pass (the new holder's lock under the old token). A
        token read twice around a held lock can still belong to a holder that
        died while the next claimer, holding the lock, is about to start the
        slot's quarantine: the slot then stays untouched for a whole
        quarantine, which outlasts any request run on it.
        """
        self._check_pid()
        if token >= LEASED or index in self._held:
            return False
        return self._word(index) == token and self._locked_elsewhere(index) and self._word(index) == token

    def sweep(self) -> int:
        """Start the quarantine of slots left leased by processes that died. Returns how many."""
        self._check_pid()
        found = 0
        for index in range(self.slots):
            if index in self._held or self._word(index) >= 0 or not self._lock(index):
                continue
            if self._word(index) < 0:
                self._set(index, self._dead_lease_until(index, time.monotonic_ns()))
                self._set_deadline(index, 0)
                found += 1
            self._unlock(index)
        return found

    def protected_until(self, index: int) -> float:
        """``time.monotonic()`` until which slot ``index`` may still be written by a request (0: free).

        A slot in use (or left leased by a process that died) counts a whole
        quarantine from now, or from its request's deadline if that is later.
        """
        word = self._word(index)
        if index in self._held or self._locked_elsewhere(index) or word < 0:
            return self._dead_lease_until(index, time.monotonic_ns()) / 1e9
        return max(word, 0) / 1e9

    def state(self, now_ns: int | None = None) -> dict[str, int]:
        """Counts over the whole pool: ``in_use`` (locked by someone), ``protected``, ``free``."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        in_use = protected = 0
        for index in range(self.slots):
            if index in self._held or self._locked_elsewhere(index):
                in_use += 1
            elif self._word(index) < 0 or self._word(index) > now_ns:
                protected += 1
        return {"in_use": in_use, "protected": protected, "free": self.slots - in_use - protected}

    def close(self, *, keep: Iterable[int] = ()) -> int | None:
        """Unmap; release this process's slots except ``keep``.

        Slots in ``keep`` stay locked (views of them are still alive): the
        returned descriptor holds their locks, and the caller closes it when
        they are gone. Slots neither kept nor released are left marked as
        leased, so whoever takes them next quarantines them first.

        Returns:
            The descriptor still holding kept slots, or None.
        """
        if self._pid != os.getpid():
            self._leave_parent()
        fd, self._fd = self._fd, -1
        _tables.discard(self)
        self._view.release()
        self.segment.close()
        if fd < 0:
            return None
        kept = set(keep) & self._held.keys()
        self._held.clear()
        if kept:
            with _kept_lock:
                _kept_fds.add(fd)
            return fd
        os.close(fd)
        return None
