"""Writing a connection's answers: a message and its status, as the client's windows and pace allow.

:class:`AnswerWriter` is the writing part of
:class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection` (a base of its
:class:`~ray_triton_shm._private.serve.http2.h2_control.ConnectionControl`), which sets up the
state it uses (the socket, the write lock, the send windows, the streams). It writes
through :class:`~ray_triton_shm._private.serve.http2.h2_output.FrameWriter`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_triton_shm._private.serve.http2.h2_headers import encode_block
from ray_triton_shm._private.serve.http2.h2_output import FrameWriter
from ray_triton_shm._private.serve.http2.h2_stream import Stream
from ray_triton_shm._private.serve.http2.h2_wire import (
    CANCEL,
    NO_ERROR,
    RST_STREAM,
    StreamGone,
    frame_header,
    percent_encode,
    status_number,
)
from ray_triton_shm._private.serve.net.bounded import OverBudget
from ray_triton_shm._private.serve.net.listener import send_within

logger = logging.getLogger(__name__)

_RESPONSE_HEADERS = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-accept-encoding", "identity,deflate,gzip"),
]
_RESPONSE_BLOCK = encode_block(_RESPONSE_HEADERS)
_OK_BLOCK = encode_block([("grpc-status", "0")])


@dataclass(eq=False)
class ParkedAnswer:
    """The rest of an answer its client did not take in time, written by the connection's reader as the
    client's windows and socket take it (its worker has gone back to the pool).

    Attributes:
        stream: The call's stream.
        views: The answer's bytes not framed yet (memory of its own, not a slot's).
        remaining: How many (the 5-byte message prefix included, if not sent).
        first: Its headers are not sent yet.
        trailers: Its status block.
        held: Bytes held against the listener's ``max_unsent_bytes`` for it.
        deadline: When it ends unsent (``time.monotonic()``) unless the client takes some of it.
    """

    stream: Stream
    views: list[memoryview]
    remaining: int
    first: bool
    trailers: bytes
    held: int
    deadline: float


class AnswerWriter(FrameWriter):
    """Writes answers on a connection (a base of ``H2Connection``, which sets its state up)."""

    _parked: list[ParkedAnswer]
    _streams: dict[int, Stream]

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
            release: Gives back the memory ``parts`` are views of (a slot). In a worker
                thread, once the message is written, ``parts`` is emptied and ``release``
                called before the status is sent. When the client
                does not take the answer within the slot stall time, the unsent bytes are
                copied, ``parts`` is emptied, ``release`` is called, and the rest is sent
                from the copy. Any answer not taken within the stall time is held against
                the listener's ``max_unsent_bytes`` until it is sent; with no room left,
                its connection ends. In a worker thread such an answer is parked: its
                rest is written by the connection's reader as the client takes it, and
                the worker goes back to the pool at once.
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
        elif threading.current_thread() is not self._reader_thread:
            self._answer_or_park(stream, parts, trailers, release, stall_s)
            return
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
                            status = self._header_frames(sid, trailers, True) if not remaining else []
                            if release is None:
                                frames, status = frames + status, []
                            self._send_locked(frames, stalled if watching else None, stall, wait=True)
                            if status:  # the message is written: its slot goes back before the status
                                frames, views = [], []
                                parts.clear()
                                if release is not None:
                                    release()
                                    release = None
                                self._send_locked(status, wait=True)
                    if stale:  # the windows are taken again under the settings in force
                        self._unreserve(stream, take)
                    frames = []
            finally:
                self._unsent.give(held)
        if not stream.ended:  # answered before the client finished sending: stop it
            self._send_reset(sid, NO_ERROR)

    def _answer_or_park(
        self,
        stream: Stream,
        parts: list[bytes | memoryview],
        trailers: bytes,
        release: Callable[[], None] | None,
        stall_s: float | None,
    ) -> None:
        """:meth:`answer` in a worker: written while the client takes it; what it does not take within the
        stall time (or all of it, when the connection's output already waits on the client) is copied out
        of its slot, held against ``max_unsent_bytes`` and parked for the reader to write."""
        sid = stream.id
        length = sum(memoryview(p).nbytes for p in parts)
        views = [memoryview(b"\x00" + length.to_bytes(4, "big"))] + [memoryview(p).cast("B") for p in parts]
        stall = self._slot_stall_s if stall_s is None else stall_s
        remaining = length + 5
        first = True
        rest: list[memoryview] = []
        while remaining:
            take, epoch = self._reserve(stream, remaining, time.monotonic() + stall)
            if not take:
                break  # the client opens no window
            with self._write:
                if epoch != self._settings_epoch or self._tail:  # stale windows, or output waits already
                    self._unreserve(stream, take)
                    break
                frames = self._header_frames(sid, _RESPONSE_BLOCK, False) if first else []
                first = False
                remaining -= take
                frames += self._data_frames(sid, views, take)
                # A slot's message is all written before its status: the slot goes back in
                # between, so the client, once it has the status, finds it free for its next call.
                status = self._header_frames(sid, trailers, True) if not remaining else []
                if release is None:
                    frames, status = frames + status, []
                try:
                    rest = send_within(self._sock, frames, stall)
                    del frames
                    if rest:  # a frame begun: its rest is the tail now, before any other write
                        self._tail_rest_locked([*rest, *map(memoryview, status)], release is not None)
                        break
                    if status:
                        views.clear()
                        parts.clear()
                        release()
                        release = None
                        rest = send_within(self._sock, status, stall)
                        if rest:
                            self._tail_rest_locked(rest, False)
                            break
                except OverBudget as e:
                    self._end_unsent(e)
                except OSError as e:
                    self._end_broken(e)
        if not remaining and not rest:
            if not stream.ended:  # answered before the client finished sending: stop it
                self._send_reset(sid, NO_ERROR)
            return
        if remaining:
            self._park(stream, views, remaining, first, trailers, parts, release)
        elif not stream.ended:  # all of it is in the tail: stop the client's side too
            self._send_reset(sid, NO_ERROR)

    def _park(
        self,
        stream: Stream,
        views: list[memoryview],
        remaining: int,
        first: bool,
        trailers: bytes,
        parts: list[bytes | memoryview],
        release: Callable[[], None] | None,
    ) -> None:
        """Hand the rest of an answer, ``remaining`` bytes of ``views``, to the reader: copied out of
        the slot (and the slot given back) if ``release``, held against ``max_unsent_bytes``."""
        want = sum(v.nbytes for v in views)
        try:
            self._unsent.take(want)
        except OverBudget as e:
            views.clear()
            self._end_unsent(e)
        if release is not None:
            views[:] = [memoryview(b"".join(views))] if views else []
            parts.clear()
            release()
        parked = ParkedAnswer(
            stream=stream,
            views=views,
            remaining=remaining,
            first=first,
            trailers=trailers,
            held=want,
            deadline=time.monotonic() + self._send_timeout_s,
        )
        with self._write:
            if self._closed:  # the connection ended meanwhile: nothing more is written
                self._unsent.give(want)
                raise StreamGone()
            stream.parked = True
            self._parked.append(parked)

    def output_deadline(self) -> float | None:
        """The earliest time (``time.monotonic()``) the waiting output must move by, or ``None``."""
        times = [p.deadline for p in self._parked]
        if self._tail:
            times.append(self._tail_since + self._send_timeout_s)
        return min(times, default=None)

    def flush_output(self) -> None:
        """Write the tail and parked answers as far as the socket and the client's windows take them now
        (in the reader's thread; nothing waits here). A parked answer whose client took none of it
        within the send timeout is reset (``CANCEL``).

        Raises:
            StreamGone: The connection ended (a failed write, or a tail the client did not take
                within the send timeout).
        """
        now = time.monotonic()
        with self._write:
            try:
                if self._tail:
                    self._queue_locked([])
                    if self._tail:
                        if now - self._tail_since > self._send_timeout_s:
                            raise OSError("the client took none of the output within the send timeout")
                        return
                for parked in list(self._parked):
                    if self._flush_parked_locked(parked, now):
                        self._finish_parked_locked(parked)
                    if self._tail:
                        return
            except OSError as e:
                self._end_broken(e)

    def _flush_parked_locked(self, parked: ParkedAnswer, now: float) -> bool:
        """Write what the windows and the socket take of ``parked`` now; whether it is over."""
        stream = parked.stream
        if stream.reset or self._closed:
            return True
        while parked.remaining:
            with self._flow:
                take = min(parked.remaining, stream.send_window, self._send_window)
                if take <= 0:
                    break
                stream.send_window -= take
                self._send_window -= take
            frames = self._header_frames(stream.id, _RESPONSE_BLOCK, False) if parked.first else []
            parked.first = False
            parked.remaining -= take
            parked.deadline = now + self._send_timeout_s
            frames += self._data_frames(stream.id, parked.views, take)
            if not parked.remaining:
                frames += self._header_frames(stream.id, parked.trailers, True)
                if not stream.ended:  # answered before the client finished sending: stop it
                    frames += [frame_header(4, RST_STREAM, 0, stream.id), NO_ERROR.to_bytes(4, "big")]
            # What the socket does not take now stays held, as the tail's.
            moved = min(take, parked.held)
            parked.held -= moved
            self._queue_locked(frames, moved)
            if self._tail:
                break
        if not parked.remaining:
            return True
        if now > parked.deadline:  # the client opened no window for it in time
            self._queue_locked([frame_header(4, RST_STREAM, 0, stream.id), CANCEL.to_bytes(4, "big")])
            return True
        return False

    def _finish_parked_locked(self, parked: ParkedAnswer) -> None:
        """``parked`` is written (or given up): its memory and its stream go."""
        self._parked.remove(parked)
        held, parked.held = parked.held, 0
        parked.views.clear()
        if held:
            self._unsent.give(held)
        stream = parked.stream
        with self._flow:
            stream.parked = False
            stream.done = True
            if stream.ended or stream.reset:
                self._streams.pop(stream.id, None)
            self._flow.notify_all()

    def drop_output(self) -> None:
        """The connection is over: what waits on the client goes, its memory given back."""
        with self._write:
            self._tail = []
            self._give_tail_locked()
            for parked in list(self._parked):
                self._finish_parked_locked(parked)
