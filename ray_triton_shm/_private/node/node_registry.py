"""Who uses a node actor.

Pure Python (no Ray). :class:`Users` is the node actor's registry of the
processes that use its Triton (Serve replicas, Data workers, ``NodeClient``
owners): the actor stops once the last one is gone for its grace period.
A user proves it lives with a :class:`UserLock`: an open-file-description
lock on one byte, at an offset of its own (62 random bits), of the actor's
*users file* (a one-byte segment the actor owns; locks may lie past its end).
The kernel drops the lock when the user dies, whatever pid namespace it runs
in, so the actor never judges a user by a pid that may mean another process
(or none) in its own namespace, and a user leaves no file of its own behind.

Example:
    >>> from ray_triton_shm._private.shm.segment import Segment, new_segment_name
    >>> users_file = Segment.create(new_segment_name("users"), 1)
    >>> users = Users(users_file.name)
    >>> lock = UserLock()
    >>> lock.hold(users_file.name)
    >>> users.attach("replica-1", os.getpid(), "serve", lock=lock.offset)
    >>> users.idle_for()
    0.0
"""

from __future__ import annotations

import fcntl
import os
import secrets
import struct
import threading
import time
import weakref
from dataclasses import dataclass

from ray_triton_shm._private.shm.segment import (
    SHM_DIR,
    process_start_time,
    validate_segment_name,
)
from ray_triton_shm.errors import InputError, SharedMemoryError, UnavailableError

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid


def _byte(kind: int, offset: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)


# User locks of this process: a forked child closes its copies (it is not the user).
_user_locks: weakref.WeakSet[UserLock] = weakref.WeakSet()


def _drop_inherited_user_locks() -> None:
    for lock in list(_user_locks):
        lock._forget()


os.register_at_fork(after_in_child=_drop_inherited_user_locks)


class UserLock:
    """A user process's proof of life for its node actor (see the module docstring).

    Create it once per user; :meth:`hold` takes the lock in a node actor's
    users file (again whenever the actor, and so the file, changes). A forked
    child holds no copy of it.
    """

    def __init__(self) -> None:
        self.offset = secrets.randbits(62) | 1
        self.users_file = ""
        self._fd = -1
        self._pid = os.getpid()
        _user_locks.add(self)

    def hold(self, users_file: str) -> None:
        """Hold this user's byte of ``users_file`` (letting go of any other file's). Idempotent.

        Raises:
            SharedMemoryError: The file cannot be opened, or the byte is locked by another user.
        """
        if self._pid != os.getpid():
            self._forget()
        if users_file == self.users_file and self._fd >= 0:
            return
        validate_segment_name(users_file)
        self.close()
        try:
            fd = os.open(os.path.join(SHM_DIR, users_file), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SharedMemoryError(f"cannot open users file {users_file!r}: {e.strerror}") from e
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _byte(fcntl.F_WRLCK, self.offset))
        except OSError as e:
            os.close(fd)
            raise SharedMemoryError(f"cannot lock byte {self.offset} of {users_file!r}: {e}") from e
        self._fd, self.users_file = fd, users_file

    def _forget(self) -> None:
        """In a forked child: close the copy (the parent's lock stays the parent's)."""
        fd, self._fd, self.users_file = self._fd, -1, ""
        self._pid = os.getpid()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Let go of the lock. Idempotent."""
        if self._pid != os.getpid():
            self._forget()
            return
        fd, self._fd, self.users_file = self._fd, -1, ""
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class User:
    """One registered user: a process on this node."""

    user_id: str
    pid: int
    start_time: int | None
    kind: str
    since: float
    lock: int | None = None  # its byte of the users file (see UserLock)


class Users:
    """The users of one node actor; thread-safe.

    A user is gone when it detaches or its process dies (checked by
    :meth:`reap`: its byte of the users file is no longer locked; for a user
    that sent no lock, its pid no longer runs with the start time it had at
    attach, or never did here).

    Args:
        users_file: The users file (a segment the actor owns) users lock their byte of.

    Raises:
        SharedMemoryError: The users file cannot be opened.
    """

    def __init__(self, users_file: str | None = None) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, User] = {}
        self._empty_since: float | None = time.monotonic()
        self.users_file = users_file or ""
        self._fd = -1
        if users_file:
            try:
                path = os.path.join(SHM_DIR, users_file)
                self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                raise SharedMemoryError(f"cannot open users file {users_file!r}: {e.strerror}") from e

    def _held(self, offset: int) -> bool:
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _byte(fcntl.F_WRLCK, offset))
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK

    def _alive(self, user: User) -> bool:
        if user.lock is not None:
            return self._fd >= 0 and self._held(user.lock)
        # No lock: only a pid seen running at attach, and still running since, counts.
        return user.start_time is not None and process_start_time(user.pid) == user.start_time

    def attach(self, user_id: str, pid: int, kind: str, lock: int | None = None) -> None:
        """Register ``user_id`` (process ``pid``, alive while it locks byte ``lock`` of the users file).

        Attaching again refreshes it.

        Raises:
            InputError: ``lock`` is not a byte offset, or this registry has no users file.
            UnavailableError: The byte is not locked: the user locked another
                actor's users file (this actor replaced it); it must look again.
        """
        if lock is not None:
            if isinstance(lock, bool) or not isinstance(lock, int) or not 0 < lock < 1 << 62:
                raise InputError(f"user lock must be a byte offset in 1..2**62-1, got {lock!r}")
            if self._fd < 0:
                raise InputError("this node actor takes no user locks")
            if not self._held(lock):
                raise UnavailableError(f"user {user_id} holds no lock in users file {self.users_file}")
        with self._lock:
            self._users[user_id] = User(user_id, pid, process_start_time(pid), kind, time.monotonic(), lock)
            self._empty_since = None

    def detach(self, user_id: str) -> bool:
        """Forget ``user_id``. Returns whether it was registered."""
        with self._lock:
            gone = self._users.pop(user_id, None) is not None
            self._mark_if_empty()
            return gone

    def reap(self) -> list[User]:
        """Forget users whose process is gone; return them."""
        with self._lock:
            dead = [u for u in self._users.values() if not self._alive(u)]
            for user in dead:
                del self._users[user.user_id]
            self._mark_if_empty()
            return dead

    def _mark_if_empty(self) -> None:
        if not self._users and self._empty_since is None:
            self._empty_since = time.monotonic()

    def start_idle_clock(self) -> None:
        """Count idle time from now, if no user is registered (the actor is ready for them only now)."""
        with self._lock:
            if not self._users:
                self._empty_since = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the last user went (or since this registry began); 0 while any is registered."""
        with self._lock:
            return 0.0 if self._empty_since is None else time.monotonic() - self._empty_since

    def snapshot(self) -> list[dict[str, object]]:
        """Users as plain dicts (for ``status``)."""
        with self._lock:
            now = time.monotonic()
            return [
                {"user": u.user_id, "pid": u.pid, "kind": u.kind, "for_s": round(now - u.since, 1)}
                for u in sorted(self._users.values(), key=lambda u: u.since)
            ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._users)

    def __contains__(self, user_id: object) -> bool:
        with self._lock:
            return user_id in self._users

    def close(self) -> None:
        """Close the users file's descriptor. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
