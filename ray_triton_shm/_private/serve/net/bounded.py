"""Bodies read or inflated within a byte limit: the error past it, and a bounded ``gzip``/``deflate``."""

from __future__ import annotations

import contextlib
import sys
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
        spares: Buffers kept for reuse by what takes from this budget (default: the parent's;
            without a parent, none are kept).
    """

    def __init__(
        self, limit: int, what: str, parent: ByteBudget | None = None, spares: SpareBuffers | None = None
    ) -> None:
        self.limit = limit
        self.what = what
        self._parent = parent
        if spares is None:
            spares = parent.spares if parent is not None else SpareBuffers(0)
        self.spares = spares
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


class SpareBuffers:
    """Buffers given back after use, kept (at most ``limit`` bytes of them) for the next ones.

    A buffer of a message read into memory is written once and dropped. Allocated anew each
    time, its pages are mapped by the kernel on first touch (a fault each 4 KiB, about 1 ms of
    system time per MB); a kept buffer's pages are mapped already. Only a buffer nothing else
    refers to is kept (no view of it is alive), so a kept buffer is never written while
    something still reads it.

    Args:
        limit: Bytes kept at most (``0``: none).
        smallest: Buffers shorter than this are not kept (what a fault costs them is small).
    """

    def __init__(self, limit: int, smallest: int = 64 * 1024) -> None:
        self.limit = limit
        self.smallest = smallest
        self._held = 0
        self._free: dict[int, list[bytearray]] = {}  # by length
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes kept now."""
        with self._lock:
            return self._held

    def take(self, low: int, high: int) -> bytearray | None:
        """The smallest kept buffer of ``low`` to ``high`` bytes (its contents are old), or ``None``."""
        with self._lock:
            if not self._free:
                return None
            found = self._free.get(low)
            if found is None:
                fits = [n for n in self._free if low <= n <= high]
                if not fits:
                    return None
                found = self._free[min(fits)]
            buffer = found.pop()
            if not found:
                del self._free[len(buffer)]
            self._held -= len(buffer)
            return buffer

    def give(self, buffer: bytearray) -> None:
        """Keep ``buffer`` for a later :meth:`take` if there is room and nothing else refers to it.

        The caller must hold no reference of its own to ``buffer`` after this call.
        """
        # Three references: the caller's, this argument, getrefcount's own. A view (a
        # memoryview, a numpy array over one) holds one more.
        if sys.getrefcount(buffer) <= 3:
            self.keep(buffer)

    def keep(self, buffer: bytearray) -> None:
        """:meth:`give` for a caller that knows nothing else refers to ``buffer``."""
        if len(buffer) < self.smallest:
            return
        with self._lock:
            if self._held + len(buffer) > self.limit:
                return
            self._free.setdefault(len(buffer), []).append(buffer)
            self._held += len(buffer)


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
