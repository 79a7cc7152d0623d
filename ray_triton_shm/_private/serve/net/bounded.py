"""Bodies read or inflated within a byte limit: the error past it, and a bounded ``gzip``/``deflate``."""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections import deque
from collections.abc import Iterator

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


class OverBudget(Exception):
    """Memory asked of a :class:`ByteBudget` that it does not have (``what`` says which limit)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class ByteBudget:
    """Bytes that buffers may hold at once, shared by threads: :meth:`take` before, :meth:`give` after.

    Args:
        limit: Bytes held at most.
        what: Names the limit in :class:`OverBudget`.
        parent: A budget every take is also taken from (a listener's, for a connection's).
    """

    def __init__(self, limit: int, what: str, parent: ByteBudget | None = None) -> None:
        self.limit = limit
        self.what = what
        self._parent = parent
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes.

        Raises:
            OverBudget: This budget, or its parent's, would pass its limit (nothing is taken).
        """
        with self._lock:
            if self._used + n > self.limit:
                raise OverBudget(self.what)
            self._used += n
        if self._parent is not None:
            try:
                self._parent.take(n)
            except OverBudget:
                with self._lock:
                    self._used -= n
                raise

    def give(self, n: int) -> None:
        """Hold ``n`` bytes fewer (bytes taken before)."""
        with self._lock:
            self._used -= n
        if self._parent is not None:
            self._parent.give(n)


class ByteTurns:
    """Bytes of work that may be in hand at once, shared by threads: :meth:`turn` waits for room.

    Turns are taken in the order they were asked for, so a large piece of work is
    not passed over by small ones; one larger than ``limit`` waits for all the room.

    Args:
        limit: Bytes in hand at most.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._line: deque[object] = deque()
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    @property
    def waiting(self) -> int:
        """Turns asked for and not yet given."""
        with self._cond:
            return len(self._line)

    @contextlib.contextmanager
    def turn(self, n: int) -> Iterator[None]:
        """Hold ``n`` bytes (at most ``limit``) while the block runs, waiting first for room."""
        n = min(n, self.limit)
        me = object()
        with self._cond:
            self._line.append(me)
            try:
                while self._line[0] is not me or self._used + n > self.limit:
                    self._cond.wait()
            finally:
                self._line.remove(me)
                self._cond.notify_all()  # the next in line may fit too (or be first now)
            self._used += n
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()
