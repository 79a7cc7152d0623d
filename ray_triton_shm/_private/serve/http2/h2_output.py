"""A connection's output: whole frames written in order, header blocks, DATA frames within windows.

:class:`FrameWriter` is the lowest writing part of
:class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection` (a base of its
:class:`~ray_triton_shm._private.serve.http2.h2_send.AnswerWriter`), which sets up the
state it uses (the socket, the write lock, the send windows). What the socket does not
take at once is the connection's tail, written before anything else as the client reads;
a write that fails, or an answer not taken with no room to hold it, ends the connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from ray_triton_shm._private.serve.http2.h2_stream import Stream
from ray_triton_shm._private.serve.http2.h2_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    RST_STREAM,
    StreamGone,
    frame_header,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget
from ray_triton_shm._private.serve.net.listener import Unsent, send_parts, send_within

logger = logging.getLogger(__name__)


class FrameWriter:
    """Writes whole frames on a connection (a base of ``H2Connection``, which sets its state up)."""

    _sock: socket.socket
    _write: threading.Lock
    _flow: threading.Condition
    _size_update: bytes
    _peer_max_frame: int
    _send_window: int
    _settings_epoch: int
    _closed: bool
    _reader_thread: threading.Thread | None
    _slot_stall_s: float
    _send_timeout_s: float
    _unsent: ByteBudget
    _tail: list[memoryview]  # frame bytes the socket did not take yet: written before anything else
    _tail_since: float  # when the client last took some of the tail
    _tail_held: int  # bytes of the tail held against _unsent (copies of answers)

    def _read_one_frame(self, timeout: float, give_up: bool = True) -> None:
        raise NotImplementedError

    def _send(self, parts: Sequence[bytes | memoryview]) -> None:
        with self._write:
            self._send_locked(parts)

    def _send_reset(self, stream_id: int, code: int) -> None:
        """Send RST_STREAM ``code`` for ``stream_id``."""
        self._send([frame_header(4, RST_STREAM, 0, stream_id), code.to_bytes(4, "big")])

    def _send_locked(
        self,
        parts: Sequence[Any],
        on_stall: Unsent | None = None,
        stall_s: float | None = None,
        wait: bool = False,
    ) -> None:
        """Write ``parts`` (whole frames; called with the write lock held); a failed write ends the connection
        (and raises ``StreamGone``).

        Unless ``wait``, nothing waits on the client here: what the socket does not take now waits in
        the connection's tail, which the reader writes as the client reads (and the connection ends if it
        takes none of it within the send timeout). With ``wait`` (an answer written by the reader's own
        call), the write waits, as :func:`send_parts` with ``on_stall``; an answer not taken that
        ``on_stall`` has no room to hold ends the connection too.
        """
        try:
            if not wait:
                self._queue_locked(parts)
                return
            if self._tail:
                parts, self._tail = [*self._tail, *parts], []
                self._give_tail_locked()
            send_parts(self._sock, parts, self._slot_stall_s if stall_s is None else stall_s, on_stall)
        except OverBudget as e:
            self._end_unsent(e)
        except OSError as e:
            self._end_broken(e)

    def _queue_locked(self, parts: Sequence[Any], held: int = 0) -> None:
        """Write the tail and ``parts`` as far as the socket takes them now; the rest is the new tail.

        ``parts`` must be memory of their own (not a slot's); ``held``: bytes of them held against
        the listener's ``max_unsent_bytes``, given back once the tail is written.

        Raises:
            OSError: The send failed.
        """
        self._tail_held += held
        if not self._tail:
            self._tail_since = time.monotonic()
        before = sum(v.nbytes for v in self._tail)
        self._tail = send_within(self._sock, [*self._tail, *parts], 0.0)
        left = sum(v.nbytes for v in self._tail)
        if left < before + sum(memoryview(p).nbytes for p in parts):
            self._tail_since = time.monotonic()
        if not self._tail:
            self._give_tail_locked()

    def _give_tail_locked(self) -> None:
        held, self._tail_held = self._tail_held, 0
        if held:
            self._unsent.give(held)

    def _end_broken(self, error: OSError) -> NoReturn:
        """A write failed: the connection ends (its socket shut down).

        Raises:
            StreamGone: Always.
        """
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        raise StreamGone() from error

    def _end_unsent(self, error: OverBudget) -> NoReturn:
        """End the connection of an answer not taken that has no room to be held.

        Raises:
            StreamGone: Always.
        """
        logger.info("front door gRPC: an answer not taken, and no room to hold it (%s)", error.what)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        raise StreamGone() from error

    def _header_frames(self, stream_id: int, block: bytes, end_stream: bool) -> list[bytes]:
        """A header ``block`` as HEADERS (+ CONTINUATION) frames; called with the write lock held."""
        if self._size_update:
            block, self._size_update = self._size_update + block, b""
        size = self._peer_max_frame
        chunks = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
        frames = []
        for index, chunk in enumerate(chunks):
            kind = HEADERS if index == 0 else CONTINUATION
            flags = (END_STREAM if end_stream and index == 0 else 0) | (
                END_HEADERS if index == len(chunks) - 1 else 0
            )
            frames += [frame_header(len(chunk), kind, flags, stream_id), chunk]
        return frames

    def _tail_rest_locked(self, rest: list[memoryview], copy: bool) -> None:
        """``rest`` (frame bytes the socket did not take, the tail empty) becomes the tail, held
        against ``max_unsent_bytes`` (copied first if ``copy``: views of a slot).

        Raises:
            OverBudget: No room to hold it (the caller ends the connection).
        """
        size = sum(v.nbytes for v in rest)
        self._unsent.take(size)
        self._tail = [memoryview(b"".join(rest))] if copy else list(rest)
        rest.clear()
        self._tail_held += size
        self._tail_since = time.monotonic()

    def _check(self, stream: Stream) -> None:
        if stream.reset or self._closed:
            raise StreamGone()

    def _reserve(self, stream: Stream, want: int, stall_at: float | None = None) -> tuple[int, int]:
        """Take up to ``want`` bytes of both send windows, waiting while either is closed.

        A call running in the reader's thread reads the client's frames itself
        meanwhile (its window updates among them).

        Returns:
            The bytes taken (``0``: the windows were still closed at ``stall_at``, a
            ``time.monotonic()`` time), and the settings epoch they were taken under:
            the frames may be written only while it is current (the client's SETTINGS
            acknowledged in between may have shrunk the stream's window).
        """
        deadline = time.monotonic() + self._send_timeout_s
        while True:
            with self._flow:
                self._check(stream)
                take = min(want, stream.send_window, self._send_window)
                if take > 0:
                    stream.send_window -= take
                    self._send_window -= take
                    return take, self._settings_epoch
                now = time.monotonic()
                if stall_at is not None and now >= stall_at:
                    return 0, self._settings_epoch
                remaining = deadline - now
                if remaining <= 0:
                    raise StreamGone()
                if stall_at is not None:
                    remaining = min(remaining, stall_at - now)
                if threading.current_thread() is not self._reader_thread:
                    self._flow.wait(remaining)
                    continue
            self._read_one_frame(remaining, give_up=stall_at is None)

    def _unreserve(self, stream: Stream, take: int) -> None:
        """Give back ``take`` bytes of both send windows, taken by ``_reserve`` and not sent."""
        with self._flow:
            stream.send_window += take
            self._send_window += take
            self._flow.notify_all()

    def _data_frames(self, stream_id: int, views: list[memoryview], count: int) -> list[Any]:
        """DATA frames of the next ``count`` bytes of ``views`` (consumed from its front)."""
        frames: list[Any] = []
        size = self._peer_max_frame
        while count:
            frame = min(count, size)
            count -= frame
            frames.append(frame_header(frame, DATA, 0, stream_id))
            while frame:
                view = views[0]
                if len(view) <= frame:
                    frames.append(view)
                    frame -= len(view)
                    views.pop(0)
                else:
                    frames.append(view[:frame])
                    views[0] = view[frame:]
                    frame = 0
        return frames
