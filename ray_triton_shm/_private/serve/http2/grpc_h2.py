"""One connection of the front door's gRPC server: HTTP/2 on a blocking socket, read by a thread of its own.

The server (:class:`~ray_triton_shm._private.serve.http2.h2_listener.H2Listener`)
runs an :class:`H2Connection` per client connection. It speaks the part of
HTTP/2 (RFC 9113) that gRPC clients use, unary calls only (the protocol's numbers are in
:mod:`~ray_triton_shm._private.serve.http2.h2_wire`, the socket reader and the per-stream
pieces in its siblings ``h2_reader`` and ``h2_stream``):

* Each request message is read from the socket straight into one buffer of its
  own size (no per-frame copies); the connection advertises 16 MB frames and
  windows of 2 GB, so a client sends a large message in a few frames without
  waiting for window updates. Clients that send small frames anyway have the
  frames of messages going into slots read in runs, in C (see ``h2_receive``).
* The answer's parts (views of a shared-memory slot, say) go to the socket as
  they are (``sendmsg``), cut into frames the client accepts and within its
  flow-control windows.
* A handler gets a :class:`~ray_triton_shm._private.serve.http2.h2_stream.Call` (its method,
  metadata and request message) and answers with ``respond`` or ``abort``. A call
  that is the connection's only one, with nothing more to read, runs in the
  connection's own thread (no hand-over to a worker and back: a client calling
  one at a time); any other runs on the worker pool. A call running in the
  connection's thread reads the client's frames itself while it waits for a
  flow-control window.

Frames are read by :class:`~ray_triton_shm._private.serve.http2.h2_receive.FrameReceiver`,
header blocks with ``hpack`` (:mod:`~ray_triton_shm._private.serve.http2.h2_headers`);
answers are written by :class:`~ray_triton_shm._private.serve.http2.h2_send.AnswerWriter`, and the
connection's own frames (settings, PING, windows, GOAWAY) handled by
:class:`~ray_triton_shm._private.serve.http2.h2_control.ConnectionControl`. Request
messages compressed with ``gzip`` or ``deflate`` are inflated; answers are sent uncompressed.
A method may have a *placer*: its messages' tensors are then read straight into a slot
(:mod:`~ray_triton_shm._private.serve.http2.grpc_message`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray_triton_shm._private.serve.http2.grpc_message import Placer
from ray_triton_shm._private.serve.http2.h2_control import set_kernel_timeout
from ray_triton_shm._private.serve.http2.h2_headers import HeaderDecoder
from ray_triton_shm._private.serve.http2.h2_reader import FrameReader
from ray_triton_shm._private.serve.http2.h2_receive import FrameReceiver, Refuse
from ray_triton_shm._private.serve.http2.h2_send import ParkedAnswer
from ray_triton_shm._private.serve.http2.h2_stream import Call, Stream
from ray_triton_shm._private.serve.http2.h2_wire import (
    DEFAULT_FRAME,
    MAX_WINDOW,
    NO_ERROR,
    Budget,
    CallError,
    H2Limits,
    H2ProtocolError,
    StreamGone,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget
from ray_triton_shm._private.serve.net.listener import IDLE_LINGER_S

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 0.5  # while calls run, how often the reader looks whether the connection went idle
_EXPIRY_CHECKS_PER_TICK = 4  # how often, between frames, slow messages are looked for


class H2Connection(FrameReceiver):
    """One client connection: reads frames, runs each complete call on ``pool``, writes the answers.

    Args:
        sock: The connected socket.
        handler: Runs a :class:`Call` (in a thread of ``pool``).
        refuse: Given a call's method and metadata as its headers arrive, the error
            that ends it at once (the client need not send its message), or ``None``.
        pool: Where calls run.
        limits: What the connection may cost (message and header sizes, timeouts, budgets).
        budget: The listener's budget of request bytes held in memory, shared by its
            connections (``None``: one of the limits' ``max_buffered_bytes`` of its own).
        place: Given a call's method, the placer of its request message, or ``None``
            (see :mod:`~ray_triton_shm._private.serve.http2.grpc_message`).
        held_pool: Where calls whose message is already in a slot run (``None``: ``pool``).
            Kept apart so that they never wait behind calls that wait for a slot: those
            slots come back only when these calls run.
        unsent: The listener's budget of answer bytes held for clients that do not take
            them (``None``: one of the limits' ``max_unsent_bytes`` of its own).
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Call], None],
        refuse: Refuse | None,
        pool: ThreadPoolExecutor,
        limits: H2Limits,
        place: Callable[[str], Placer | None] | None = None,
        budget: ByteBudget | None = None,
        held_pool: ThreadPoolExecutor | None = None,
        unsent: ByteBudget | None = None,
    ) -> None:
        self._sock = sock
        self._place = place
        self._read_timeout = False  # set while a slot waits for a message's bytes
        self._expiry_due = 0.0  # when the slots' messages are next looked at between frames
        self._handler = handler
        self._refuse = refuse
        self._pool = pool
        self._held_pool = held_pool or pool
        self._limits = limits
        self._slot_stall_s = limits.slot_stall_s
        self._max_message = limits.max_message
        self._glitches = Budget(limits.glitch_burst, limits.glitch_rate)
        shared = budget or ByteBudget(limits.max_buffered_bytes, "the listener's max_buffered_bytes")
        what = "the connection's max_connection_bytes"
        self._budget = ByteBudget(limits.max_connection_bytes, what, shared)
        self._unsent = unsent or ByteBudget(limits.max_unsent_bytes, "the listener's max_unsent_bytes")
        self._reader = FrameReader(sock)
        self._reader.on_stall = self._stalled
        self._reader.patience = self._patience
        # Sends give up after send_timeout_s (a client that stopped reading); reads wait for ever.
        self._send_timeout_s = limits.send_timeout_s
        set_kernel_timeout(sock, socket.SO_SNDTIMEO, limits.send_timeout_s)
        self._decoder = HeaderDecoder(limits.max_header_block)
        self._size_update = b""  # sent before the next header block, after the client sets a table size
        self._write = threading.Lock()  # frames are written whole, and header blocks encoded, one at a time
        self._tail: list[memoryview] = []  # frame bytes the socket has not taken yet (written first)
        self._tail_since = 0.0
        self._tail_held = 0
        self._parked: list[ParkedAnswer] = []  # answers waiting on their client, written by the reader
        self._flow = threading.Condition()  # guards the send windows and the streams
        self._streams: dict[int, Stream] = {}
        self._last_stream = 0
        self._send_window = 65535
        self._peer_initial_window = 65535
        self._peer_max_frame = DEFAULT_FRAME
        self._settings_epoch = 0  # how many of the client's SETTINGS frames were applied
        self._recv_window = MAX_WINDOW
        self._closed = False
        self._going_away = False  # the first GOAWAY is due or sent: the connection is to end
        self._preface_sent = False  # our SETTINGS went out (nothing may come before them)
        self._final_goaway = False  # the last stream is named: later streams are refused
        self._reader_thread: threading.Thread | None = None
        self._started = False  # the preface has been read
        self._inline = False  # a call is running in the reader's thread
        self._fatal: BaseException | None = None  # what ended the connection while a call ran inline

    # -- reading -------------------------------------------------------------------------
    def serve(self) -> float | None:
        """Serve the connection while it has calls or bytes to read.

        Returns:
            ``None`` when the connection is over (the client closed it, broke the
            protocol, or the server stops), or, when it is idle (no call open,
            nothing to read), how long it may stay so: the caller waits for its next
            bytes without a thread (then calls ``serve`` again) or calls :meth:`expire`.
        """
        self._reader_thread = threading.current_thread()
        try:
            ready = True  # called when the socket has bytes: read a frame before anything else
            if not self._started:
                self._started = True
                self._start()
                ready = False
            while self._fatal is None:
                if ready:
                    ready = False
                elif not self._reader.buffered():
                    if self._idle():
                        # A client calling again at once is read here; one that pauses is parked.
                        if select.select([self._sock], [], [], IDLE_LINGER_S)[0]:
                            self._frame()
                            continue
                        return self._limits.idle_timeout_s
                    # A call still runs: look again now and then (it may end with nothing more to
                    # read); a slot waiting for a message's bytes waits no longer than its stall time
                    # (looked at each tick: shorter once another call waits for a slot); output
                    # waiting on the client is written as the socket takes it.
                    wait = self._tick() if self._read_timeout else _IDLE_CHECK_S
                    deadline = self.output_deadline()
                    if deadline is not None:
                        wait = max(0.0, min(wait, deadline - time.monotonic()))
                    readable, writable, _ = select.select(
                        [self._sock], [self._sock] if self._tail else [], [], wait
                    )
                    if writable or (self._parked and not readable):
                        self.flush_output()
                    if not readable:
                        if self._read_timeout:
                            if time.monotonic() - self._reader.last_read >= self._patience():
                                self._stalled()
                            else:
                                self._expire_placements()
                        continue
                if self._read_timeout and time.monotonic() >= self._expiry_due:
                    self._expire_placements()  # a few times a tick, not before every frame
                    self._expiry_due = time.monotonic() + self._tick() / _EXPIRY_CHECKS_PER_TICK
                self._frame()
                if self._parked or self._tail:  # a window may have opened
                    self.flush_output()
            raise self._fatal
        except H2ProtocolError as e:
            logger.warning("front door gRPC: a connection ended with GOAWAY %d: %s", e.code, e.message)
            self._goaway(e.code, e.message)
        except (EOFError, OSError, StreamGone) as e:  # the client went away, or the server is stopping
            if not self._idle():
                logger.info("front door gRPC: a connection ended with calls open: %r", e.__cause__ or e)
        self._close()
        return None

    def expire(self) -> None:
        """The connection stayed idle past its time: GOAWAY (``NO_ERROR``) if it fits the socket at once.

        The caller closes the connection; nothing here waits for the client.
        """
        frame = self._goaway_frame(NO_ERROR, "idle")
        with self._write, contextlib.suppress(OSError):
            self._queue_locked([frame])
        self._close()

    def _idle(self) -> bool:
        with self._flow:
            return not self._streams and not self._tail

    def _dispatch(self, stream: Stream) -> None:
        stream.dispatched = True
        if stream.ended and self._may_run_inline(stream):
            # The connection's only call, and nothing more to read: run it here, sparing
            # a hand-over to a worker thread and back (a client calling one at a time).
            self._inline = True
            try:
                self._run(stream)
            finally:
                self._inline = False
            return
        (self._held_pool if stream.holds_slot() else self._pool).submit(self._run, stream)

    def _may_run_inline(self, stream: Stream) -> bool:
        if self._inline or threading.current_thread() is not self._reader_thread:
            return False
        with self._flow:
            # Any other stream open: the reader stays free. A call run here may wait for a slot,
            # and the slot may be one that another stream's message, still arriving, holds.
            if any(s is not stream for s in self._streams.values()):
                return False
        if self._reader.buffered():
            return False
        try:
            return not self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": closed
        except BlockingIOError:
            return True  # nothing waiting on the socket
        except OSError:
            return False

    def _update_read_timeout(self) -> None:
        """Bound reads by the slot stall time while a slot waits for a message's bytes."""
        with self._flow:
            want = any(stream.placing() for stream in self._streams.values())
        if want != self._read_timeout:
            self._set_read_timeout(self._tick() if want else 0)
            self._read_timeout = want

    def _tick(self) -> float:
        """How often a read that waits for a slot's bytes looks whether it has waited too long."""
        return min(self._limits.slot_stall_s, self._limits.slot_busy_stall_s)

    def _patience(self) -> float:
        """How long a read may wait for the client's next bytes now: no time at all (the timeout is
        the preface's) unless a slot waits for a message; then the slot stall time, the busy one
        while another call waits for a slot of such a pool."""
        if not self._read_timeout:
            return 0.0
        with self._flow:
            busy = any(stream.slot_busy() for stream in self._streams.values())
        return self._limits.slot_stall(busy)

    def _expire_placements(self) -> None:
        """Messages still arriving for a slot past their time (too slow overall) move to memory."""
        now = time.monotonic()
        slot_time = self._limits.slot_time
        with self._flow:
            late = [
                s
                for s in self._streams.values()
                if s.placing() and now >= s.place_started + slot_time(s.message_length(), s.slot_busy())
            ]
        for stream in late:
            stream.to_memory()
        if late:
            self._update_read_timeout()

    def _stalled(self) -> None:
        """A read waited past the stall time while slots wait: their messages move to memory, slots back.

        Raises:
            TimeoutError: No slot waits: the timeout was the preface's.
        """
        if not self._read_timeout:
            raise TimeoutError("the client did not send its preface in time")
        with self._flow:
            streams = list(self._streams.values())
        for stream in streams:
            stream.to_memory()
        self._update_read_timeout()

    def _reset(self, stream: Stream, code: int) -> None:
        """End ``stream`` with RST_STREAM ``code`` (a stream error); its call, if running, is abandoned."""
        with self._flow:
            self._streams.pop(stream.id, None)
            stream.reset = True
            if not stream.dispatched:
                stream.release()
            self._flow.notify_all()
        self._send_reset(stream.id, code)

    # -- running calls -------------------------------------------------------------------
    def _run(self, stream: Stream) -> None:
        call = Call(self, stream)
        try:
            if not stream.reset:  # reset by the client before it began: not run at all
                run_call(self._handler, call, stream.error)
        finally:
            if not stream.answered:
                call.abort("INTERNAL", "the server did not answer the call")
            stream.release()  # a placement the handler did not take
            with self._flow:
                if not stream.parked:  # else the reader ends it once its answer is written
                    stream.done = True
                    if stream.ended:
                        self._streams.pop(stream.id, None)

    def _read_one_frame(self, timeout: float, give_up: bool = True) -> None:
        """Read one frame in the reader's thread while its call waits (the connection's end ends the call).

        Nothing within ``timeout``: ``StreamGone`` if ``give_up``, else nothing read.
        """
        try:
            if not self._reader.buffered() and not select.select([self._sock], [], [], timeout)[0]:
                if not give_up:
                    return
                raise StreamGone()
            self._frame()
        except StreamGone:
            raise
        except (H2ProtocolError, EOFError, OSError) as e:
            self._fatal = e
            self._close()
            raise StreamGone() from e

    def _close(self) -> None:
        with self._flow:
            self._closed = True
            for stream in self._streams.values():
                stream.reset = True
                if not stream.dispatched:
                    stream.release()
            self._flow.notify_all()
        self.drop_output()

    def busy(self) -> bool:
        """Whether a call is still running."""
        with self._flow:
            return any(s.dispatched and not s.done for s in self._streams.values())


def run_call(handler: Callable[[Any], None], call: Any, error: CallError | None = None) -> None:
    """Run ``handler(call)`` (or answer ``error`` instead), a failure answered as gRPC does: a
    :class:`CallError` with its status, any other exception ``INTERNAL`` (logged), a client
    already gone not at all."""
    try:
        if error is not None:
            raise error
        handler(call)
    except StreamGone:
        pass
    except CallError as e:
        call.abort(e.code, e.message)
    except Exception as e:
        logger.warning("front door gRPC: %s failed", call.method, exc_info=e)
        call.abort("INTERNAL", f"{type(e).__name__}: {e}")
