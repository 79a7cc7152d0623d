"""HTTP/2 as the front door's gRPC server speaks it: frames, settings, streams, buffered reads.

The pieces of :mod:`~ray_triton_shm._private.serve.http2.grpc_h2` that hold no
connection state of their own: the protocol's numbers (RFC 9113), the errors
that end a connection or a call, a socket reader whose large reads go straight
into their target, a stream's request message as it arrives, and a call as its
handler sees it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ray_triton_shm._private.serve.http2.grpc_message import (
    MessageBuffer,
    PlacedMessage,
    Placement,
    Placer,
    Stalled,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget, inflate
from ray_triton_shm.errors import ConfigError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (RFC 9113, section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 6, 7, 8, 9, 11
# Settings.
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 3, 4, 5
MAX_HEADER_LIST_SIZE = 6

MAX_WINDOW = 2**31 - 1
OUR_MAX_FRAME = 2**24 - 1
"""The largest frame this server accepts (HTTP/2's own limit): big messages come in few frames."""
DEFAULT_FRAME = 16384
"""A peer's frame size limit until its settings say otherwise."""
READ_AHEAD = 16384
"""The most a frame reader asks the socket for beyond the bytes it needs (what it reads ahead of a
large DATA payload is copied once more, from its buffer into the payload's target)."""
READER_BUFFER = 64 * 1024
"""A connection's read buffer (frame heads, control frames, header blocks up to its size)."""
MAX_HEADER_BLOCK = 64 * 1024
"""Longest header block (request headers and metadata), and longest header list it decodes to,
accepted by default; longer ends the connection (nghttp2's default header list limit, 64 KiB)."""
IDLE_TIMEOUT_S = 60.0
"""How long a connection with no call open may stay quiet before the server sends GOAWAY and closes it."""
PREFACE_TIMEOUT_S = 10.0
"""How long a new connection has to send its whole preface and first SETTINGS."""
MAX_CONNECTION_BYTES = 256 * 1024 * 1024
"""Request bytes one connection's messages may hold in memory at once (beyond: ``RESOURCE_EXHAUSTED``)."""
MAX_BUFFERED_BYTES = 1024 * 1024 * 1024
"""Request bytes all of a listener's connections may hold in memory at once (beyond: as above)."""
GLITCH_BURST = 1000
GLITCH_RATE = 33.0
"""The budget of frames that cost the server work but carry no call (PING, SETTINGS, PRIORITY,
RST_STREAM, empty DATA and CONTINUATION): ``GLITCH_BURST`` at once, refilled at ``GLITCH_RATE``
a second (nghttp2's stream-reset and glitch limits). Past it: GOAWAY ``ENHANCE_YOUR_CALM``."""
MAX_STREAMS = 1024
"""Streams a connection may have open at once (announced in the settings)."""
SEND_TIMEOUT_S = 60.0
"""How long an answer may wait for the client to open its flow-control window."""
MAX_UNSENT_BYTES = 128 * 1024 * 1024
"""Answer bytes a listener holds at once for clients that do not take them within the stall time."""
SLOT_STALL_S = 1.0
"""How long a read into a slot, or a send from one, may wait for the client: past it the
message (or answer) is moved to memory and the slot given back at once."""
SLOT_BUSY_STALL_S = 0.1
""":data:`SLOT_STALL_S` while another call waits for a slot of the same pool: slow clients,
more of them than the slots, cannot keep a pool's slots while prompt callers queue."""
PLACED_CHUNK = 4 * 1024 * 1024
"""Bytes a read into a slot asks for at once: each must arrive within the slot stall time (the
busy one while another call waits for a slot): a client sending slower than this much per stall
time does not keep a slot."""


@dataclass(frozen=True, kw_only=True)
class H2Limits:
    """What one HTTP/2 connection may cost the server; each a named setting with its default.

    Raises:
        ConfigError: A value out of its range.

    Attributes:
        max_message: Largest request message accepted, inflated or not (larger: ``RESOURCE_EXHAUSTED``).
        max_header_block: Longest header block, and decoded header list, accepted.
        idle_timeout_s: Quiet time allowed with no call open (then GOAWAY and close).
        preface_timeout_s: Time a new connection has for its preface and first SETTINGS.
        glitch_burst: Call-less frames accepted at once (see :data:`GLITCH_RATE`).
        glitch_rate: Call-less frames a second accepted after the burst.
        slot_stall_s: How long a read into a slot, or an answer's send from one, may wait
            for the client before the bytes move to memory and the slot goes back.
        slot_busy_stall_s: ``slot_stall_s`` of a read into a slot while another call waits
            for a slot of its pool (also how often a slow read looks whether one does).
        max_connection_bytes: Request bytes one connection's messages may hold in memory at once.
        max_buffered_bytes: Request bytes all of a listener's connections may hold in memory at once.
        max_streams: Streams a connection may have open at once (announced in the settings;
            a stream past it is refused with ``REFUSED_STREAM``).
        send_timeout_s: How long an answer may wait for the client to take it (to open its
            flow-control window, or to read what was written).
        max_unsent_bytes: Answer bytes all of a listener's connections hold at once for
            clients that took nothing for ``slot_stall_s``; an answer with no room left
            ends its connection.
    """

    max_message: int = 64 * 1024 * 1024
    max_header_block: int = MAX_HEADER_BLOCK
    idle_timeout_s: float = IDLE_TIMEOUT_S
    preface_timeout_s: float = PREFACE_TIMEOUT_S
    glitch_burst: int = GLITCH_BURST
    glitch_rate: float = GLITCH_RATE
    slot_stall_s: float = SLOT_STALL_S
    slot_busy_stall_s: float = SLOT_BUSY_STALL_S
    max_connection_bytes: int = MAX_CONNECTION_BYTES
    max_buffered_bytes: int = MAX_BUFFERED_BYTES
    max_streams: int = MAX_STREAMS
    send_timeout_s: float = SEND_TIMEOUT_S
    max_unsent_bytes: int = MAX_UNSENT_BYTES

    def slot_time(self, length: int, busy: bool = False) -> float:
        """How long a message of ``length`` bytes may take to arrive into a slot.

        The stall time (the busy one while another call waits for a slot of the pool),
        plus the message at :data:`PLACED_CHUNK` bytes per stall time.
        """
        return self.slot_stall(busy) * (1 + length / PLACED_CHUNK)

    def slot_stall(self, busy: bool) -> float:
        """How long a read into a slot may wait for the client's next bytes now."""
        return min(self.slot_stall_s, self.slot_busy_stall_s) if busy else self.slot_stall_s

    def __post_init__(self) -> None:
        sizes = (
            "max_message",
            "max_header_block",
            "max_connection_bytes",
            "max_buffered_bytes",
            "max_unsent_bytes",
        )
        for name in (*sizes, "glitch_burst", "max_streams"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        timeouts = ("idle_timeout_s", "preface_timeout_s", "slot_stall_s", "slot_busy_stall_s")
        for name in (*timeouts, "send_timeout_s", "glitch_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")


class Budget:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` a second; :meth:`spend` says if one was left."""

    def __init__(self, burst: int, rate: float) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._tokens = float(burst)
        self._at = time.monotonic()

    def spend(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


FRAME_HEADER = struct.Struct(">HBBBI")  # length (24 bits, as 16 + 8), type, flags, stream id
SETTING = struct.Struct(">HI")


def status_number(code: str) -> int:
    """The number of gRPC status ``code`` (a ``grpc.StatusCode`` name; UNKNOWN's for any other)."""
    status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
    return status.value[0]


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    """The 9-byte header of a frame."""
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


def percent_encode(message: str) -> str:
    """``grpc-message``'s encoding: UTF-8, with ``%`` and bytes outside printable ASCII as ``%XX``."""
    return "".join(
        chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in message.encode("utf-8")
    )


class H2ProtocolError(Exception):
    """The connection breaks the protocol: it gets a GOAWAY with ``code`` and is closed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


class StreamGone(Exception):
    """The stream was reset by the client, or its connection closed, before the answer was sent."""


class CallError(Exception):
    """A call that ends with a gRPC status other than OK (raised by a handler, or while reading).

    Args:
        code: The status's name (``INVALID_ARGUMENT``, ...).
        message: The status message.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


def metadata_of(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A call's metadata: its headers other than HTTP/2's pseudo-headers and gRPC's own."""
    return [
        (k, v)
        for k, v in headers
        if not k.startswith((":", "grpc-")) and k not in ("content-type", "te", "user-agent")
    ]


class FrameReader:
    """Buffered reads from a blocking socket; large reads go straight into their target.

    While the socket has a receive timeout (``SO_RCVTIMEO``, set while a slot
    waits for bytes), a read that times out asks :attr:`patience` how long it may
    wait now; past that it raises :class:`Stalled` if it was for a slot
    (``placed``), and otherwise calls :attr:`on_stall` (which moves the slots'
    messages to memory and clears the timeout) and goes on waiting. The receive
    timeout is thus the tick at which a slow read looks again, and the patience
    may change meanwhile (shorter once another call waits for a slot).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(READER_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.on_stall: Callable[[], None] | None = None
        self.patience: Callable[[], float] | None = None
        self.last_read = time.monotonic()  # when bytes last came from the socket

    def _stalled(self, placed: bool, taken: int, since: float) -> None:
        """A read timed out, waiting since ``since``: returns if it may wait on, else stalls."""
        if self.patience is not None and time.monotonic() - since < self.patience():
            return
        if placed:
            raise Stalled(taken)
        if self.on_stall is None:
            raise TimeoutError("a read from the client timed out")
        self.on_stall()

    def _fill(self, want: int, placed: bool = False) -> None:
        if self._start:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        while self._end < want:
            try:
                got = self._sock.recv_into(self._view[self._end : max(want, self._end + READ_AHEAD)])
            except BlockingIOError:  # the receive timeout
                self._stalled(placed, 0, self.last_read)
                continue
            if not got:
                raise EOFError
            self._end += got
            self.last_read = time.monotonic()

    def exactly(self, n: int, placed: bool = False) -> bytes:
        """The next ``n`` bytes (``n`` at most the buffer's size).

        Raises:
            Stalled: ``placed``, and the bytes did not come in time (none were taken).
        """
        if self._end - self._start < n:
            self._fill(n, placed)
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def unread(self, n: int) -> None:
        """Take back the last ``n`` bytes :meth:`exactly` returned (they are read again next)."""
        self._start -= n

    def into(self, target: memoryview, placed: bool = False) -> None:
        """Fill ``target``: first from the buffer, then straight from the socket.

        Raises:
            Stalled: ``placed``, and a part of :data:`PLACED_CHUNK` bytes did not
                arrive within the receive timeout (the bytes taken are in ``target``).
        """
        have = min(self._end - self._start, len(target))
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        step = PLACED_CHUNK if placed else len(target)
        since = time.monotonic()  # when the part being read was asked for
        end = min(have + step, len(target))
        while have < len(target):
            try:
                # MSG_WAITALL: one wake-up (and one return to Python) for the whole rest, not one per packet.
                got = self._sock.recv_into(target[have:end], 0, socket.MSG_WAITALL)
            except BlockingIOError:  # the receive timeout, nothing read
                got = -1
            if not got:
                raise EOFError
            if got > 0:
                have += got
                self.last_read = time.monotonic()
            if have == end:
                since, end = self.last_read, min(have + step, len(target))
            else:  # the receive timeout with the part not all read
                self._stalled(placed, have, since if placed else self.last_read)

    def buffered(self) -> int:
        """Bytes read from the socket and not yet taken."""
        return self._end - self._start

    def skip(self, n: int) -> None:
        while n:
            take = min(n, len(self._buf))
            if take <= self._end - self._start:
                self._start += take
            else:
                self.into(memoryview(bytearray(take)))
            n -= take

    def payload(self, n: int) -> bytes:
        """A frame payload of ``n`` bytes (any size)."""
        if n <= len(self._buf):
            return self.exactly(n)
        data = bytearray(n)
        self.into(memoryview(data))
        return bytes(data)


class Stream:
    """One call: its headers, its request message as it arrives, its send window."""

    def __init__(
        self,
        stream_id: int,
        headers: list[tuple[str, str]],
        send_window: int,
        max_message: int,
        placer: Placer | None = None,
        budget: ByteBudget | None = None,
    ):
        self.id = stream_id
        self.headers = headers
        self.metadata = metadata_of(headers)
        self.send_window = send_window
        self.max_message = max_message
        self.placer = placer  # where an uncompressed message's bytes go (None: a plain buffer)
        self.budget = budget  # what the message's buffer is taken from
        self.prefix = bytearray()
        self.message: MessageBuffer | PlacedMessage | None = None
        self.messages = 0
        self.error: CallError | None = None
        self.ended = False  # the client's side is closed (END_STREAM seen)
        self.reset = False  # the client reset it, or the connection is gone
        self.dispatched = False  # handed to a worker
        self.answered = False  # its answer has begun
        self.done = False  # its worker has finished
        self.parked = False  # its answer waits on the client, written by the connection's reader
        self.place_started = 0.0  # when a slot began to wait for the message's bytes

    def receive(self, reader: FrameReader, count: int) -> None:
        """``count`` bytes of the stream's DATA, read from ``reader`` into the message."""
        while count:
            if self.error is not None:
                reader.skip(count)
                return
            if self.message is None or self.message.full():
                if self.message is not None:
                    self.error = CallError("UNIMPLEMENTED", "this server takes one request message per call")
                    continue
                take = min(count, 5 - len(self.prefix))
                self.prefix += reader.exactly(take)
                count -= take
                if len(self.prefix) < 5:
                    continue
                length = int.from_bytes(self.prefix[1:5], "big")
                if length > self.max_message:
                    self.error = CallError(
                        "RESOURCE_EXHAUSTED",
                        f"Received message larger than max ({length} vs. {self.max_message})",
                    )
                    continue
                self.messages += 1
                try:
                    if self.placer is not None and not self.prefix[0] and length:
                        self.message = PlacedMessage(length, self.placer, self.budget)
                    else:
                        self.message = MessageBuffer(length, budget=self.budget)
                except OverBudget as e:
                    self._over(e)
                continue
            try:
                count -= self.message.take(reader, count)
            except OverBudget as e:
                self._over(e)

    def _over(self, error: OverBudget) -> None:
        """The message does not fit the server's memory budget: it is refused, its bytes dropped."""
        self.release()
        self.message = None
        self.error = CallError(
            "RESOURCE_EXHAUSTED", f"the server holds too many request bytes at once ({error.what}); try again"
        )

    def placing(self) -> bool:
        """Whether a slot is held for the message while its bytes still arrive."""
        return isinstance(self.message, PlacedMessage) and self.message.placing()

    def slot_busy(self) -> bool:
        """Whether another call waits for a slot of the pool this stream's message is read into."""
        return self.placing() and self.message.placement.busy()  # type: ignore[union-attr]

    def holds_slot(self) -> bool:
        """Whether the complete message is in a slot (taken by :meth:`placement`)."""
        return (
            self.error is None
            and isinstance(self.message, PlacedMessage)
            and self.message.placement is not None
            and self.message.full()
        )

    def message_length(self) -> int:
        """The length of the message being read (``0``: none yet)."""
        return self.message.length if self.message is not None else 0

    def placement(self) -> Placement | None:
        """The complete message's placement (its slot now the caller's to give back), or ``None``."""
        if self.error is None and isinstance(self.message, PlacedMessage) and self.message.full():
            placement, self.message.placement = self.message.placement, None
            return placement
        return None

    def to_memory(self) -> None:
        """A message being read into a slot goes on in memory; the slot goes back now."""
        if isinstance(self.message, PlacedMessage):
            try:
                self.message.to_memory()
            except OverBudget as e:
                self._over(e)

    def release(self) -> None:
        """Give back the slot of a placement no call took, and the message's memory (idempotent)."""
        if isinstance(self.message, PlacedMessage):
            self.message.release()
        elif isinstance(self.message, MessageBuffer):
            self.message.free()

    def request(self) -> bytes | bytearray:
        """The complete request message (inflated).

        Raises:
            CallError: No message, a truncated one, or one compressed in a way this server cannot read.
        """
        if self.error is not None:
            raise self.error
        if self.message is None or not self.message.full():
            raise CallError("INTERNAL", "the call ended before its request message was complete")
        try:
            data = self.message.message() if isinstance(self.message, PlacedMessage) else self.message.data
        except OverBudget as e:
            self._over(e)
            raise self.error from e  # type: ignore[misc]
        if not self.prefix[0]:
            return data
        encoding = self.header("grpc-encoding") or "identity"
        if encoding not in ("gzip", "deflate"):
            raise CallError(
                "UNIMPLEMENTED",
                f"the request message is compressed with {encoding!r}; this server reads gzip and deflate",
            )
        try:
            return inflate(bytes(data), encoding, self.max_message)
        except Exception as e:
            raise CallError("INTERNAL", f"the request message cannot be inflated: {e}") from e

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Call:
    """One unary call as its handler sees it.

    Attributes:
        method: The full method name (``/package.Service/Method``).
        metadata: The client's metadata (headers other than HTTP/2's and gRPC's own).
    """

    def __init__(self, connection: Any, stream: Stream) -> None:
        self._connection = connection
        self._stream = stream
        self.method = stream.header(":path") or ""
        self.metadata = stream.metadata

    def request(self) -> bytes | bytearray:
        """The request message's bytes.

        Raises:
            CallError: As :meth:`Stream.request`.
        """
        return self._stream.request()

    @property
    def cancelled(self) -> bool:
        """Whether the client reset the call or closed its connection (its answer would go nowhere)."""
        return self._stream.reset

    def placement(self) -> Placement | None:
        """Where the request message was read into, if its method's placer placed it (see
        :mod:`~ray_triton_shm._private.serve.http2.grpc_message`); the slot is then the caller's to give back.
        ``None``: read the message with :meth:`request`.
        """
        return self._stream.placement()

    def respond(
        self,
        parts: list[bytes | memoryview],
        release: Callable[[], None] | None = None,
        stall_s: float | None = None,
    ) -> None:
        """Answer with one message made of ``parts`` (sent as they are), then status OK.

        Args:
            parts: The message's parts.
            release: Gives back the memory ``parts`` are views of (a slot): called (``parts``
                emptied) once the message is written, before the status; or, if the client
                does not take the answer within the slot stall time, the rest is copied,
                ``parts`` emptied and ``release`` called; the answer goes on from the copy.
            stall_s: The stall time for this answer (``None``: the limits' ``slot_stall_s``).

        Raises:
            StreamGone: The client reset the call or went away first.
        """
        self._connection.answer(self._stream, parts, "OK", "", release, stall_s)

    def abort(self, code: str, message: str) -> None:
        """End the call with status ``code`` and ``message`` (no answer message)."""
        with contextlib.suppress(StreamGone):
            self._connection.answer(self._stream, None, code, message)
