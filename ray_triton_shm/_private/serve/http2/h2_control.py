"""A gRPC connection's own frames: the preface, SETTINGS, PING, WINDOW_UPDATE and GOAWAY.

:class:`ConnectionControl` is the connection-level half of
:class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection` (which reads the
frames, sets up the state used here and runs the streams): the exchange of prefaces
and settings, the client's settings applied in step with their acknowledgement,
flow-control windows, the budget of frames that carry no call, and the two-step
GOAWAY of a graceful stop (RFC 9113, section 6.8).
"""

from __future__ import annotations

import contextlib
import socket
import struct

from ray_triton_shm._private.serve.http2.h2_headers import TABLE_SIZE_ZERO
from ray_triton_shm._private.serve.http2.h2_reader import FrameReader
from ray_triton_shm._private.serve.http2.h2_send import AnswerWriter
from ray_triton_shm._private.serve.http2.h2_stream import Stream
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    DEFAULT_FRAME,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    OUR_MAX_FRAME,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    SETTING,
    SETTINGS,
    WINDOW_UPDATE,
    Budget,
    H2Limits,
    H2ProtocolError,
    StreamGone,
    frame_header,
)

# A graceful stop in two steps (RFC 9113, section 6.8): first a GOAWAY that still takes every stream
# (its last stream ID the largest there is) and this PING; once the client acknowledges the PING,
# every stream it opened before it read the GOAWAY has arrived, and a second GOAWAY names the last.
_DRAIN_PING = b"draining"
_ANY_STREAM = 0x7FFFFFFF


class ConnectionControl(AnswerWriter):
    """The connection's own frames (a base of ``H2Connection``, which sets its state up)."""

    _reader: FrameReader
    _limits: H2Limits
    _glitches: Budget
    _streams: dict[int, Stream]
    _last_stream: int
    _peer_initial_window: int
    _going_away: bool
    _preface_sent: bool
    _final_goaway: bool

    def _frame(self) -> None:
        raise NotImplementedError

    def _reset(self, stream: Stream, code: int) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        """Read the client's preface and first SETTINGS, and send ours.

        Raises:
            H2ProtocolError: Not HTTP/2's preface and SETTINGS.
            EOFError, OSError: The client went away, or took longer than the preface timeout.
        """
        # The preface and the client's first SETTINGS come within PREFACE_TIMEOUT_S, in all.
        self._set_read_timeout(self._limits.preface_timeout_s)
        if self._reader.exactly(len(PREFACE)) != PREFACE:
            raise EOFError  # not HTTP/2 with prior knowledge: nothing a gRPC client sends
        settings = [
            (MAX_CONCURRENT_STREAMS, self._limits.max_streams),
            (INITIAL_WINDOW_SIZE, MAX_WINDOW),
            (MAX_FRAME_SIZE, OUR_MAX_FRAME),
            (MAX_HEADER_LIST_SIZE, self._limits.max_header_block),
        ]
        body = b"".join(SETTING.pack(k, v) for k, v in settings)
        update = (MAX_WINDOW - 65535).to_bytes(4, "big")
        frames = [frame_header(len(body), SETTINGS, 0, 0), body, frame_header(4, WINDOW_UPDATE, 0, 0), update]
        with self._write:
            self._preface_sent = True
            if self._going_away:  # the server began to stop before the client's preface came
                frames += self._first_goaway()
            self._send_locked(frames)
        if self._reader.exactly(9)[3] != SETTINGS:
            raise H2ProtocolError(PROTOCOL_ERROR, "the preface is not followed by SETTINGS")
        self._reader.unread(9)
        self._frame()
        self._set_read_timeout(0)

    def _set_read_timeout(self, seconds: float) -> None:
        """A kernel timeout (``SO_RCVTIMEO``) on each read; ``0``: none."""
        set_kernel_timeout(self._sock, socket.SO_RCVTIMEO, seconds)

    def _glitch(self, what: str) -> None:
        """Count a frame that carries no call against the connection's budget."""
        if not self._glitches.spend():
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"too many frames without a call ({what})")

    def _ping(self, payload: bytes, flags: int, stream_id: int) -> None:
        """Answer a PING; the acknowledgement of the drain's PING sends the final GOAWAY."""
        if len(payload) != 8 or stream_id:
            code = FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR
            raise H2ProtocolError(code, "a malformed PING")
        if not flags & ACK:
            self._glitch("PING")
            self._send([frame_header(8, PING, ACK, 0), payload])
        elif payload == _DRAIN_PING and self._going_away and not self._final_goaway:
            self._final_goaway = True
            self._goaway(NO_ERROR, "the server is stopping")

    def _settings(self, payload: bytes, flags: int, stream_id: int) -> None:
        """Apply the client's settings and acknowledge them, in one hold of the write lock.

        A client may hold us to its new values only once it has our ACK (gRPC checks
        frame sizes and windows against the settings acknowledged): every frame
        written before the ACK keeps to the old values, and every frame after it to
        the new ones (see ``AnswerWriter._reserve`` for windows taken meanwhile).
        """
        if stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS frame of a partial setting")
        settings = [SETTING.unpack_from(payload, offset) for offset in range(0, len(payload), 6)]
        for key, value in settings:
            if key == INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
                raise H2ProtocolError(FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
            if key == MAX_FRAME_SIZE and not DEFAULT_FRAME <= value <= OUR_MAX_FRAME:
                raise H2ProtocolError(PROTOCOL_ERROR, f"a maximum frame size of {value}")
        with self._write:
            with self._flow:
                for key, value in settings:
                    if key == INITIAL_WINDOW_SIZE:
                        delta = value - self._peer_initial_window
                        self._peer_initial_window = value
                        for stream in self._streams.values():
                            stream.send_window += delta
                            if stream.send_window > MAX_WINDOW:
                                message = f"stream {stream.id}'s window over 2^31-1"
                                raise H2ProtocolError(FLOW_CONTROL_ERROR, message)
                    elif key == MAX_FRAME_SIZE:
                        self._peer_max_frame = value
                    elif key == HEADER_TABLE_SIZE:
                        self._size_update = TABLE_SIZE_ZERO  # our blocks never use the table
                self._settings_epoch += 1
                self._flow.notify_all()
            self._send_locked([frame_header(0, SETTINGS, ACK, 0)])

    def _window_update(self, payload: bytes, stream_id: int) -> None:
        if len(payload) != 4:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        failed = None  # a stream error (RFC 9113, 6.9): that stream is reset, the connection goes on
        with self._flow:
            if not stream_id:
                if not increment:
                    raise H2ProtocolError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
                self._send_window += increment
                if self._send_window > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            else:
                stream = self._streams.get(stream_id)
                if stream is not None:
                    stream.send_window += increment
                    if not increment:
                        failed = stream, PROTOCOL_ERROR
                    elif stream.send_window > MAX_WINDOW:
                        failed = stream, FLOW_CONTROL_ERROR
            self._flow.notify_all()
        if failed is not None:
            self._reset(*failed)

    # -- going away ----------------------------------------------------------------------
    def _goaway_frame(self, code: int, message: str, last_stream: int | None = None) -> bytes:
        debug = message.encode()[:256]
        last = self._last_stream if last_stream is None else last_stream
        return (
            frame_header(8 + len(debug), GOAWAY, 0, 0)
            + last.to_bytes(4, "big")
            + code.to_bytes(4, "big")
            + debug
        )

    def _goaway(self, code: int, message: str) -> None:
        with contextlib.suppress(OSError, StreamGone):
            self._send([self._goaway_frame(code, message)])

    def _first_goaway(self) -> list[bytes]:
        """The first step of a graceful stop: GOAWAY taking every stream, and the PING that ends it."""
        goaway = self._goaway_frame(NO_ERROR, "the server is stopping", _ANY_STREAM)
        return [goaway, frame_header(8, PING, 0, 0), _DRAIN_PING]

    def go_away(self) -> None:
        """Tell the client no new calls are taken; calls begun still run, and so do calls in flight.

        The client gets GOAWAY and a PING; streams it opened before it read the
        GOAWAY are served. When it acknowledges the PING, a second GOAWAY names
        the last stream served, and any stream after it is refused
        (``REFUSED_STREAM``: never run, so the client may send it again elsewhere).
        """
        with self._write:
            if self._going_away:
                return
            self._going_away = True
            if self._preface_sent:  # else it goes out right after our SETTINGS
                with contextlib.suppress(OSError, StreamGone):
                    self._send_locked(self._first_goaway())


def set_kernel_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """Set ``SO_RCVTIMEO`` or ``SO_SNDTIMEO`` (a ``timeval``) on ``sock``; ``0``: none."""
    whole = int(seconds)
    micro = int((seconds - whole) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micro))
