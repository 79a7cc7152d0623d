"""A request's body as its handler reads it: into a buffer of its choice, or whole into memory that grows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ray_triton_shm._private.serve.http1.head import (
    MAX_CHUNK_EXTENSION_BYTES,
    MAX_CHUNK_LINE_BYTES,
    MAX_HEAD_BYTES,
    HttpParseError,
    RequestHead,
    check_trailer,
    chunk_size,
)
from ray_triton_shm._private.serve.http1.timing import BodyClock, Deadline, HttpTimeouts
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget, too_large
from ray_triton_shm.errors import InputError, RefusedError


class Reader(Protocol):
    """What a body reads from: its connection (``http1.server.Connection``)."""

    timeouts: HttpTimeouts

    def read_exactly(
        self, target: memoryview, clock: Deadline | BodyClock, stall_s: float | None = None
    ) -> int: ...

    def read_line(self, clock: Deadline | BodyClock, limit: int) -> bytes: ...

    def send_parts(
        self, parts: Sequence[bytes | memoryview], stall_s: float | None = None
    ) -> list[memoryview]: ...


RECV_BYTES = 64 * 1024
"""A connection's read buffer (a request head, chunk lines, small reads)."""


_GROW_BYTES = 64 * 1024  # a body read whole starts with this much room and doubles as it fills


class Body:
    """The body of one request, read from what the head's buffer already holds, then the socket.

    What it reads whole grows as bytes arrive (doubling, from 64 KiB): a client
    that announces a large body and sends little gets little memory.

    Args:
        conn: The connection.
        head: The request's head (its length or chunked encoding).
        budget: What the bytes read into memory are taken from as they grow (the
            listener's), given back by :meth:`release`; ``None``: no budget.
    """

    def __init__(self, conn: Reader, head: RequestHead, budget: ByteBudget | None = None) -> None:
        self._conn = conn
        self._budget = budget
        self.charged = 0
        self._clock: BodyClock | None = None
        self._chunked = head.chunked
        self.remaining = 0 if self._chunked else head.content_length
        self._continue = (
            head.headers.get("expect", "").lower() == "100-continue" and head.version == "HTTP/1.1"
        )

    def _charge(self, n: int) -> None:
        """Take ``n`` more bytes of memory from the budget.

        Raises:
            RefusedError: The budget has too little (``UNAVAILABLE``: HTTP 503).
        """
        if self._budget is None or n <= 0:
            return
        try:
            self._budget.take(n)
        except OverBudget as e:
            raise RefusedError(
                f"the server holds too many request bytes at once ({e.what}); try again", "UNAVAILABLE"
            ) from e
        self.charged += n

    def release(self) -> None:
        """Give the bytes read into memory back to the budget (once the request is answered; idempotent)."""
        if self._budget is not None and self.charged:
            self._budget.give(self.charged)
        self.charged = 0

    @property
    def chunked(self) -> bool:
        """Whether the body is chunked and not read yet (it can only be read whole then)."""
        return self._chunked

    def _begin(self) -> BodyClock:
        if self._continue:  # the client waits for this before it sends the body
            self._continue = False
            self._conn.send_parts([b"HTTP/1.1 100 Continue\r\n\r\n"])
        if self._clock is None:
            timeouts = self._conn.timeouts
            self._clock = BodyClock(timeouts.body_grace_s, timeouts.body_min_rate)
        return self._clock

    def readinto(
        self,
        target: memoryview,
        stall_s: Callable[[], float] | None = None,
        tick_s: float | None = None,
    ) -> int:
        """Fill ``target`` with the next ``len(target)`` bytes of the body.

        Args:
            target: Where the bytes go (a slot's memory, say).
            stall_s: How long the read may take before it stops early (``None``: as long
                as the body's clock allows); asked again every ``tick_s`` while it waits.
            tick_s: How often ``stall_s`` is asked.

        Returns:
            How many bytes were read: ``len(target)``, or fewer when the client
            stalled for ``stall_s`` (the rest is still to read).

        Raises:
            InputError: The body is chunked, or shorter than ``len(target)``.
            HttpTimeoutError: The body came too slowly (see :class:`HttpTimeouts`).
            ConnectionGone: The peer closed the connection.
        """
        if self._chunked:
            raise InputError("a chunked body is read whole")  # callers check Body.chunked first
        if len(target) > self.remaining:
            raise InputError("the request body is shorter than its Content-Length")
        got = self._conn.read_exactly(target, self._begin(), stall_s, tick_s)
        self.remaining -= got
        return got

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes (at most what is left).

        Raises:
            HttpTimeoutError: The body came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        out = bytearray()
        self._append(out, min(n, self.remaining))
        return bytes(out)

    def read_all(self, max_bytes: int | None = None) -> bytes:
        """The rest of the body (a chunked body de-chunked).

        Args:
            max_bytes: Largest body accepted (``None``: no limit).

        Raises:
            RequestTooLargeError: The body is larger than ``max_bytes``.
            HttpParseError: A malformed chunked body; :class:`HttpTimeoutError`
                when the body came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        out = bytearray()
        self.read_rest_into(out, max_bytes)
        return bytes(out)

    def read_rest_into(self, out: bytearray, max_bytes: int | None = None) -> None:
        """Append the rest of the body (de-chunked) to ``out``, which grows as the bytes arrive.

        Args:
            out: The buffer (it may hold bytes already).
            max_bytes: Largest ``len(out)`` accepted (``None``: no limit).

        Raises:
            As :meth:`read_all`.
        """
        self._charge(len(out) - self.charged)  # bytes it holds already that were not read through here
        if not self._chunked:
            if max_bytes is not None and len(out) + self.remaining > max_bytes:
                raise too_large("request body", max_bytes)
            self._append(out, self.remaining)
            return
        self._read_chunked(out, max_bytes)

    def _append(self, out: bytearray, n: int) -> None:
        """Read the next ``n`` bytes onto the end of ``out``, growing it no faster than they come."""
        clock = self._begin()
        end = len(out) + n
        while len(out) < end:
            start = len(out)
            grow = min(end - start, max(_GROW_BYTES, start))
            self._charge(grow)
            out.extend(bytes(grow))
            with memoryview(out) as view:
                got = self._conn.read_exactly(view[start:], clock)
            self.remaining -= got

    def _read_chunked(self, out: bytearray | None, max_bytes: int | None) -> None:
        """Read a chunked body to its end: onto ``out``, or dropped (``None``)."""
        clock = self._begin()
        size_so_far = 0 if out is None else len(out)
        extensions = 0
        scratch = memoryview(bytearray(RECV_BYTES)) if out is None else None
        while True:
            size, extension = chunk_size(self._conn.read_line(clock, MAX_CHUNK_LINE_BYTES))
            extensions += extension
            if extensions > MAX_CHUNK_EXTENSION_BYTES:
                raise HttpParseError(f"chunk extensions over {MAX_CHUNK_EXTENSION_BYTES} bytes")
            if size == 0:
                self._read_trailers(clock)
                self._chunked = False
                return
            size_so_far += size
            if max_bytes is not None and size_so_far > max_bytes:
                raise too_large("request body", max_bytes)
            if out is not None:
                self.remaining = size
                self._append(out, size)
            elif scratch is not None:
                while size:
                    step = min(size, len(scratch))
                    size -= self._conn.read_exactly(scratch[:step], clock)
            end = memoryview(bytearray(2))
            self._conn.read_exactly(end, clock)
            if end != b"\r\n":
                raise HttpParseError("a chunk is not followed by CRLF (longer than its size?)")

    def _read_trailers(self, clock: BodyClock) -> None:
        """Read and drop the trailer fields, up to the blank line (each checked as a header is)."""
        total = 0
        while True:
            line = self._conn.read_line(clock, MAX_HEAD_BYTES)
            if not line:
                return
            total += len(line) + 2
            if total > MAX_HEAD_BYTES:
                raise HttpParseError("trailer fields too large", 431)
            check_trailer(line)

    def drain(self, max_bytes: int | None = None) -> None:
        """Read and drop what is left (so that the answer is read by a client still sending).

        Args:
            max_bytes: Most bytes read (``None``: no limit); a larger body is not read.

        Raises:
            RequestTooLargeError: More than ``max_bytes`` are left (close the connection).
            HttpParseError: A malformed chunked body, or one that came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        if self._chunked:
            self._read_chunked(None, max_bytes)
            return
        if max_bytes is not None and self.remaining > max_bytes:
            raise too_large("request body", max_bytes)
        clock = self._begin()
        scratch = memoryview(bytearray(min(self.remaining, RECV_BYTES)))
        while self.remaining:
            n = min(self.remaining, len(scratch))
            self.remaining -= self._conn.read_exactly(scratch[:n], clock)
