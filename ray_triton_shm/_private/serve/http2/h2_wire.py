"""HTTP/2 as the front door's gRPC server speaks it: the protocol's numbers, limits and errors.

What holds no connection state: the numbers of RFC 9113 (frame types, flags,
error codes, settings), the server's limits and their defaults (:class:`H2Limits`),
a token bucket for frames that carry no call (:class:`Budget`), a frame's header,
a gRPC status's number and ``grpc-message``'s encoding, and the errors that end
a connection or a call.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import grpc

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
MAX_SPARE_BYTES = 32 * 1024 * 1024
"""Bytes of message buffers a listener keeps, once their messages are done, for the next ones."""
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
        max_spare_bytes: Bytes of message buffers a listener keeps for the next messages once
            their own are done (their pages stay mapped; ``0``: none kept).
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
    max_spare_bytes: int = MAX_SPARE_BYTES
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
        spare = self.max_spare_bytes
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ConfigError(f"max_spare_bytes must be an integer >= 0, got {spare!r}")


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
