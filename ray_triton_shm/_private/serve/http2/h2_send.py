"""Writing a connection's answers: header blocks, and DATA frames within the client's windows.

:class:`AnswerWriter` is the writing part of
:class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection` (a base of its
:class:`~ray_triton_shm._private.serve.http2.h2_control.ConnectionControl`), which sets up the
state it uses (the socket, the write lock, the send windows, the streams).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ray_triton_shm._private.serve.http2.h2_headers import encode_block
from ray_triton_shm._private.serve.http2.h2_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    NO_ERROR,
    RST_STREAM,
    Stream,
    StreamGone,
    frame_header,
    percent_encode,
    status_number,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget
from ray_triton_shm._private.serve.net.listener import Unsent, send_parts

logger = logging.getLogger(__name__)

_RESPONSE_HEADERS = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-accept-encoding", "identity,deflate,gzip"),
]
_RESPONSE_BLOCK = encode_block(_RESPONSE_HEADERS)
_OK_BLOCK = encode_block([("grpc-status", "0")])


class AnswerWriter:
    """Writes answers on a connection (a base of ``H2Connection``, which sets its state up)."""

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

    def _read_one_frame(self, timeout: float, give_up: bool = True) -> None:
        raise NotImplementedError

    def _send(self, parts: Sequence[bytes | memoryview]) -> None:
        with self._write:
            self._send_locked(parts)

    def _send_reset(self, stream_id: int, code: int) -> None:
        """Send RST_STREAM ``code`` for ``stream_id``."""
        self._send([frame_header(4, RST_STREAM, 0, stream_id), code.to_bytes(4, "big")])

    def _send_locked(
        self, parts: Sequence[Any], on_stall: Unsent | None = None, stall_s: float | None = None
    ) -> None:
        """Write ``parts``; a failed or timed-out write ends the connection (and raises ``StreamGone``),
        as does an answer not taken that ``on_stall`` has no room to hold."""
        try:
            send_parts(self._sock, parts, self._slot_stall_s if stall_s is None else stall_s, on_stall)
        except OverBudget as e:
            self._end_unsent(e)
        except OSError as e:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            raise StreamGone() from e

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

    def answer(
        self,
        stream: Stream,
        parts: list[bytes | memoryview] | None,
        code: str,
        message: str,
        release: Callable[[], None] | None = None,
        stall_s: float | None = None,
    ) -> None:
        """Send the answer of ``stream``: headers, the message of ``parts`` (if any), and the status.

        Args:
            stream: The call's stream.
            parts: The answer message's parts (``None``: trailers only).
            code: The status's name.
            message: The status message.
            release: Gives back the memory ``parts`` are views of (a slot). When the client
                does not take the answer within the slot stall time, the unsent bytes are
                copied, ``parts`` is emptied, ``release`` is called, and the rest is sent
                from the copy. Any answer not taken within the stall time is held against
                the listener's ``max_unsent_bytes`` until it is sent; with no room left,
                its connection ends.
            stall_s: The stall time (``None``: the connection's ``slot_stall_s``).

        Raises:
            StreamGone: The client reset the stream, or the connection closed (also for
                an answer not taken with no room to hold it).
        """
        if stream.answered:
            return
        stream.answered = True
        if code == "OK" and not message:
            trailers = _OK_BLOCK
        else:
            status = [("grpc-status", str(status_number(code)))]
            if message:
                status.append(("grpc-message", percent_encode(message)))
            trailers = encode_block(status)
        sid = stream.id
        if parts is None:  # trailers only
            self._check(stream)
            with self._write:
                self._send_locked(self._header_frames(sid, _RESPONSE_BLOCK + trailers, True))
        else:
            length = sum(memoryview(p).nbytes for p in parts)
            views = [memoryview(b"\x00" + length.to_bytes(4, "big"))] + [
                memoryview(p).cast("B") for p in parts
            ]
            frames: list[Any] = []
            held = 0  # bytes of the answer held against the listener's max_unsent_bytes
            watching = True  # the client has taken each write within the stall time so far

            def stalled(unsent: list[memoryview]) -> list[memoryview]:
                """The client took nothing for the stall time: the rest of the answer is held against
                the listener's ``max_unsent_bytes`` (no room: ``OverBudget``), copied out of its slot
                (the slot given back) if it is a slot's."""
                nonlocal views, release, held, watching
                watching = False
                want = sum(v.nbytes for v in unsent) + sum(v.nbytes for v in views)
                self._unsent.take(want)
                held = want
                if release is None:
                    return unsent
                copied = [memoryview(b"".join(unsent))] if unsent else []
                unsent.clear()
                frames.clear()
                views = [memoryview(b"".join(views))] if views else []
                if parts is not None:
                    parts.clear()
                release()
                release = None
                return copied

            stall = self._slot_stall_s if stall_s is None else stall_s
            remaining = length + 5
            first = True
            try:
                while remaining:
                    stall_at = time.monotonic() + stall if watching else None
                    take, epoch = self._reserve(stream, remaining, stall_at)
                    if not take:  # the client opens no window: the answer is held (and leaves its slot)
                        try:
                            stalled([])
                        except OverBudget as e:
                            self._end_unsent(e)
                        continue
                    with self._write:
                        stale = epoch != self._settings_epoch  # new settings acknowledged since
                        if not stale:
                            remaining -= take
                            frames = self._header_frames(sid, _RESPONSE_BLOCK, False) if first else []
                            first = False
                            frames += self._data_frames(sid, views, take)
                            if not remaining:
                                frames += self._header_frames(sid, trailers, True)
                            self._send_locked(frames, stalled if watching else None, stall)
                    if stale:  # the windows are taken again under the settings in force
                        self._unreserve(stream, take)
                    frames = []
            finally:
                self._unsent.give(held)
        if not stream.ended:  # answered before the client finished sending: stop it
            self._send_reset(sid, NO_ERROR)

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
