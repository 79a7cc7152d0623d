"""A gRPC connection served by nghttp2 in C (``_h2_engine``), its calls run by the same handlers.

:class:`EngineConnection` is :class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection`'s
counterpart for the listener: ``serve``, ``expire``, ``go_away``, ``busy``. nghttp2 keeps the
protocol (frames, HPACK, flow control, SETTINGS and PING, RFC 9113's checks) and the C side
reads the socket, gathers each call's headers and request message, and writes the answers
(every frame of a send round in one ``writev``, the answer's bytes straight from the
handler's buffers, a slot's included), all without the GIL. Python is asked at a stream's
turning points (see ``_h2_engine.c``): whether the call is refused and whether its message may
be placed (the door's ``refuse`` and placer), where a placed message goes, and the complete
call, which runs in a worker thread as a :class:`EngineCall` (what a :class:`Call` offers).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray_triton_shm._private.serve.http2.grpc_h2 import run_call
from ray_triton_shm._private.serve.http2.grpc_message import HEAD_BYTES, Mismatch, Placement, Placer
from ray_triton_shm._private.serve.http2.h2_receive import Refuse
from ray_triton_shm._private.serve.http2.h2_stream import header_of, inflated, metadata_of
from ray_triton_shm._private.serve.http2.h2_wire import (
    CallError,
    H2Limits,
    StreamGone,
    percent_encode,
    status_number,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget
from ray_triton_shm._private.serve.net.listener import IDLE_LINGER_S

try:
    from ray_triton_shm._private.serve.http2 import _h2_engine
except ImportError:  # built only where nghttp2's headers were installed
    _h2_engine = None

logger = logging.getLogger(__name__)

REFUSED, BUFFER, PLACE = -1, 0, 1
# what may serve a gRPC connection (see ``FrontDoorConfig.grpc_engine``); "auto": nghttp2 where built
ENGINES = ("auto", "python", "nghttp2")


def available() -> bool:
    """Whether the nghttp2 engine was built."""
    return _h2_engine is not None


def resolved(engine: str) -> str:
    """The engine that serves for ``engine``: ``"auto"`` is nghttp2 where it was built, else python."""
    if engine == "auto":
        return "nghttp2" if available() else "python"
    return engine


class _Stream:
    __slots__ = ("compressed", "dispatched", "headers", "id", "message", "placement", "placer", "reset")

    def __init__(self, stream_id: int, headers: list[tuple[str, str]], placer: Placer | None) -> None:
        self.id = stream_id
        self.headers = headers
        self.placer = placer
        self.placement: Placement | None = None
        self.message: bytes | bool | None = False
        self.compressed = False
        self.reset = False
        self.dispatched = False

    def header(self, name: str) -> str | None:
        return header_of(self.headers, name)


class EngineCall:
    """One unary call as its handler sees it (as :class:`~.h2_stream.Call`).

    Attributes:
        method: The full method name (``/package.Service/Method``).
        metadata: The client's metadata (headers other than HTTP/2's and gRPC's own).
    """

    def __init__(self, connection: EngineConnection, stream: _Stream) -> None:
        self._connection = connection
        self._stream = stream
        self.method = stream.header(":path") or ""
        self._metadata: list[tuple[str, str]] | None = None
        self.answered = False

    @property
    def metadata(self) -> list[tuple[str, str]]:
        """The client's metadata (headers other than HTTP/2's and gRPC's own)."""
        if self._metadata is None:
            self._metadata = metadata_of(self._stream.headers)
        return self._metadata

    def request(self) -> bytes | bytearray:
        """The request message's bytes (inflated).

        Raises:
            CallError: No message, a truncated one, or one compressed in a way this server cannot read.
        """
        stream = self._stream
        if stream.message is None and stream.placement is not None:
            placement, stream.placement = stream.placement, None
            data = bytes(placement.read_so_far())
            placement.release()
            stream.message = data
        if not isinstance(stream.message, (bytes, bytearray)):
            raise CallError("INTERNAL", "the call ended before its request message was complete")
        if not stream.compressed:
            return stream.message
        return inflated(stream.message, stream.header("grpc-encoding"), self._connection.max_message)

    @property
    def cancelled(self) -> bool:
        """Whether the client reset the call or closed its connection."""
        return self._stream.reset

    def placement(self) -> Placement | None:
        """Where the request message was read into, if it was placed (the slot is then the caller's)."""
        stream = self._stream
        if stream.message is None and stream.placement is not None:
            placement, stream.placement = stream.placement, None
            return placement
        return None

    def respond(
        self,
        parts: list[bytes | memoryview],
        release: Callable[[], None] | None = None,
        stall_s: float | None = None,
    ) -> None:
        """Answer with one message made of ``parts``, then status OK.

        Returns once the parts are written, or copied out of their memory for a client that
        takes them slowly (then ``release`` has been called), or dropped with the connection.

        Raises:
            StreamGone: The client reset the call or went away first.
        """
        written = threading.Event()

        def released() -> None:
            try:
                if release is not None:
                    release()
            finally:
                written.set()

        stall = -1.0 if stall_s is None else stall_s
        if self._stream.reset or not self._connection.respond(
            self._stream.id, parts, 0, b"", released, stall
        ):
            raise StreamGone()
        self.answered = True
        # Back once the parts are written, or copied out of their memory (a client that takes its
        # answer slowly), or dropped with the connection: the caller may reuse their memory then.
        written.wait()

    def abort(self, code: str, message: str) -> None:
        """End the call with status ``code`` and ``message`` (no answer message)."""
        encoded = percent_encode(message).encode("ascii") if message else b""
        self.answered = True
        with contextlib.suppress(StreamGone):
            self._connection.respond(self._stream.id, None, status_number(code), encoded, None)


class EngineConnection:
    """One client connection served by nghttp2; its calls run on ``pool`` (placed ones on ``held_pool``).

    Args:
        sock: The connection (blocking).
        handler: Runs a call (an :class:`EngineCall`).
        refuse: Says whether a call is refused before its message is read (see ``H2Connection``).
        pool: Where calls run.
        limits: The connection's limits (``max_message`` and ``max_streams`` are kept here).
        place: The placer of a method's messages, if any (see ``H2Connection``).
        held_pool: Where calls whose message is already in a slot run (``None``: ``pool``).
        fast: Runs a call whose message was placed without a worker thread, where it can: its
            ``fast_ready()``, ``fast_begin(call)`` (the request to Triton, which the connection
            posts itself) and ``fast_finish(state, code, body, retry)`` with Triton's answer.
        budget: The listener's budget of request bytes held in memory (the connection's own,
            ``max_connection_bytes``, is taken from it).
        unsent: The listener's budget of answer bytes held for clients that do not take them.

    Raises:
        RuntimeError: The engine was not built (see :func:`available`).
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Any], None],
        refuse: Refuse | None,
        pool: ThreadPoolExecutor,
        limits: H2Limits,
        place: Callable[[str], Placer | None] | None = None,
        held_pool: ThreadPoolExecutor | None = None,
        fast: Any = None,
        budget: ByteBudget | None = None,
        unsent: ByteBudget | None = None,
    ) -> None:
        if _h2_engine is None:
            raise RuntimeError("the nghttp2 engine was not built (nghttp2's headers were missing)")
        self._sock = sock
        self._handler = handler
        self._refuse = refuse
        self._place = place
        self._pool = pool
        self._held_pool = held_pool or pool
        self._limits = limits
        self.max_message = limits.max_message
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._running: set[int] = set()
        self._fast = fast
        self._posted: dict[int, list[Any]] = {}  # stream id: [fast call state, retries left]
        shared = budget or ByteBudget(limits.max_buffered_bytes, "the listener's max_buffered_bytes")
        self._budget = ByteBudget(
            limits.max_connection_bytes, "the connection's max_connection_bytes", shared
        )
        self._unsent = unsent or ByteBudget(limits.max_unsent_bytes, "the listener's max_unsent_bytes")
        self._engine = _h2_engine.Connection(
            sock.fileno(),
            self,
            limits.max_message,
            HEAD_BYTES,
            limits.max_streams,
            glitch_burst=limits.glitch_burst,
            glitch_rate=limits.glitch_rate,
            preface_timeout_s=limits.preface_timeout_s,
            slot_stall_s=limits.slot_stall_s,
            send_timeout_s=limits.send_timeout_s,
            slot_busy_stall_s=limits.slot_busy_stall_s,
            max_header_block=limits.max_header_block,
        )

    # -- the listener's side ---------------------------------------------------------------
    def serve(self) -> float | None:
        """Serve until the connection ends (``None``) or stays idle (how long it may wait parked)."""
        if self._engine.run(IDLE_LINGER_S):
            return self._limits.idle_timeout_s
        return None

    def expire(self) -> None:
        """The connection stayed idle past its time: GOAWAY (``NO_ERROR``); the caller closes it."""
        with contextlib.suppress(OSError):
            self._engine.goodbye()

    def go_away(self) -> None:
        """Tell the client no new call will be taken."""
        self._engine.go_away()

    def busy(self) -> bool:
        """Whether a call is still running."""
        with self._lock:
            return bool(self._running)

    def respond(
        self, stream_id: int, parts: Any, status: int, message: bytes, release: Any, stall_s: float = -1.0
    ) -> bool:
        return self._engine.respond(stream_id, parts, status, message, release, stall_s)

    # -- asked by the engine (the connection's thread, with the GIL) -----------------------
    def headers(self, stream_id: int, headers: list[tuple[str, str]]) -> tuple[int, int, bytes]:
        method = next((v for k, v in headers if k == ":path"), "")
        error = self._refuse(method, headers) if self._refuse is not None else None
        if error is not None:
            return REFUSED, status_number(error.code), percent_encode(error.message).encode("ascii")
        placer = self._place(method) if self._place is not None else None
        self._streams[stream_id] = _Stream(stream_id, headers, placer)
        return (PLACE if placer is not None else BUFFER), 0, b""

    def place(self, stream_id: int, head: bytes, length: int) -> list[bytes | memoryview] | None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.placer is None:
            return None
        placement = stream.placer(head, length)
        if placement is None:
            return None
        if placement.length() != length:
            placement.release()
            return None
        try:
            placement.take_bytes(head[len(placement.head) :])
        except Mismatch:
            placement.release()
            return None
        stream.placement = placement
        return placement.rest()

    def charge(self, n: int) -> bytes | None:
        try:
            self._budget.take(n)
        except OverBudget as e:
            return f"the server holds too many request bytes at once ({e.what}); try again".encode()
        return None

    def uncharge(self, n: int) -> None:
        self._budget.give(n)

    def buffer(self, size: int, limit: int) -> bytearray | None:
        """A kept buffer of ``size`` to ``limit`` bytes for a message read into memory; ``None``: none
        is kept (the engine makes one, once its bytes are taken from the budget)."""
        return self._budget.spares.take(size, limit)

    def spare(self, buffer: bytearray) -> None:
        """A message buffer nothing else refers to, kept for another message if there is room."""
        self._budget.spares.keep(buffer)

    def charge_unsent(self, n: int) -> bool:
        """Hold ``n`` answer bytes a client did not take; ``True``: no room (the connection ends)."""
        try:
            self._unsent.take(n)
        except OverBudget:
            logger.warning(
                "front door gRPC: answers not taken pass %s; the connection ends", self._unsent.what
            )
            return True
        return False

    def uncharge_unsent(self, n: int) -> None:
        self._unsent.give(n)

    def ended(self, code: int, why: bytes) -> None:
        """The connection ends with a GOAWAY for an error (``code``), ``why`` its debug text."""
        logger.warning(
            "front door gRPC: a connection ended with GOAWAY %d: %s", code, why.decode(errors="replace")
        )

    def slot_wanted(self, stream_id: int) -> bool:
        """Whether another call waits for a slot of the pool a message is being placed into."""
        stream = self._streams.get(stream_id)
        placement = stream.placement if stream is not None else None
        return placement is not None and placement.busy()

    def unplace(self, stream_id: int, taken: int, got: bytes) -> bytes:
        stream = self._streams[stream_id]
        placement, stream.placement = stream.placement, None
        if placement is None:
            return got
        placement.filled(taken)
        data = bytes(placement.read_so_far()) + got
        placement.release()
        return data

    def dispatch(self, stream_id: int, message: bytes | bool | None, compressed: int) -> tuple | None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return None
        stream.dispatched = True
        stream.compressed = bool(compressed)
        placed = message is None and stream.placement is not None
        if placed:
            stream.placement.complete()
        stream.message = message
        with self._lock:
            self._running.add(stream_id)
        if placed and self._fast is not None and self._fast.fast_ready():
            return self._begin(stream)
        (self._held_pool if placed else self._pool).submit(self._run, stream)
        return None

    def _begin(self, stream: _Stream) -> tuple[str, int, bytes, float] | None:
        """A placed call run without a worker: its request to Triton, for the connection to post."""
        call = EngineCall(self, stream)
        begun = self._fast.fast_begin(call)
        if isinstance(begun, tuple):
            state, address, data, timeout_s = begun
            self._posted[stream.id] = [state, call, 1]
            return _to_post(address, data, timeout_s)
        self._done(stream, call, begun)
        return None

    def answered(self, stream_id: int, code: int, body: bytes) -> tuple[str, int, bytes, float] | None:
        posted = self._posted.get(stream_id)
        if posted is None:
            return None
        state, call, retries = posted
        result = self._fast.fast_finish(state, code, body, retries > 0)
        if isinstance(result, tuple) and isinstance(result[0], str):  # post once more
            posted[2] = retries - 1
            return _to_post(*result)
        del self._posted[stream_id]
        if isinstance(result, tuple):
            parts, release, stall_s = result
            if not self._engine.respond(stream_id, parts, 0, b"", release, stall_s):
                release()
            call.answered = True
            result = None
        self._done(call._stream, call, result)
        return None

    def _done(self, stream: _Stream, call: EngineCall, result: Any) -> None:
        """A fast call ended: its error answered (``result``), its bookkeeping dropped."""
        if isinstance(result, CallError):
            call.abort(result.code, result.message)
        self._streams.pop(stream.id, None)
        with self._lock:
            self._running.discard(stream.id)

    def gone(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        stream.reset = True
        if not stream.dispatched and stream.placement is not None:
            placement, stream.placement = stream.placement, None
            placement.release()

    # -- a call, in a worker --------------------------------------------------------------
    def _run(self, stream: _Stream) -> None:
        call = EngineCall(self, stream)
        try:
            if not stream.reset:
                run_call(self._handler, call)
        finally:
            if not call.answered and not stream.reset:
                call.abort("INTERNAL", "the server did not answer the call")
            placement, stream.placement = stream.placement, None
            if placement is not None:
                placement.release()
            message, stream.message = stream.message, None
            if isinstance(message, bytearray):
                self._budget.spares.give(message)  # kept unless a view of it outlived the call
            self._streams.pop(stream.id, None)
            with self._lock:
                self._running.discard(stream.id)


def _to_post(address: str, data: bytes, timeout_s: float | None) -> tuple[str, int, bytes, float]:
    """A request to Triton as the engine posts it: host, port, bytes, timeout (-1: none)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port), data, -1.0 if timeout_s is None else float(timeout_s)
