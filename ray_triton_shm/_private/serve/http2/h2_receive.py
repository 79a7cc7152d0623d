"""Reading a gRPC connection's frames: each checked as it arrives, HEADERS and DATA into their streams.

:class:`FrameReceiver` is the reading part of
:class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection` (its base, itself a
:class:`~ray_triton_shm._private.serve.http2.h2_control.ConnectionControl`), which sets up
the state it uses (the socket reader, the header decoder, the streams, the windows) and
runs the calls. A frame's length is checked before any of it is read; the connection's
own frames (SETTINGS, PING, WINDOW_UPDATE) go to ``ConnectionControl``; HEADERS (and their
CONTINUATION frames) open a stream, or end one with the client's trailers; DATA goes into
its stream's message, and the connection's receive window is opened again as it is used;
RST_STREAM ends its stream; unknown frame types are skipped. After a DATA frame of a
message going into a slot, the plain DATA frames that follow, of that stream or any other
whose message goes into a slot, are read in one run by the C reader (``_h2_data``, through
:meth:`~ray_triton_shm._private.serve.http2.h2_reader.FrameReader.data_run`): the frames
of clients that send 16 KB at a time pass the Python loop only where a run ends.
A stream goes to the connection's ``_dispatch`` once the client's side of it ends, or at
once when it is refused (an error answered before the client sends its whole message).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ray_triton_shm._private.serve.http2.grpc_message import Placer
from ray_triton_shm._private.serve.http2.h2_control import ConnectionControl
from ray_triton_shm._private.serve.http2.h2_headers import HeaderDecoder
from ray_triton_shm._private.serve.http2.h2_stream import Stream
from ray_triton_shm._private.serve.http2.h2_wire import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    OUR_MAX_FRAME,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    CallError,
    H2ProtocolError,
    frame_header,
)
from ray_triton_shm._private.serve.net.bounded import ByteBudget

# Control frames of one length only (RFC 9113, section 6), and the most a SETTINGS frame may carry.
_FIXED_LENGTH = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}
_MAX_SETTINGS_BYTES = 6 * 64
_MAX_RUN_STREAMS = 256  # streams one run of DATA frames reads for (the C reader's most)

Refuse = Callable[[str, Sequence[tuple[str, str]]], "CallError | None"]


class FrameReceiver(ConnectionControl):
    """Reads the client's frames (a base of ``H2Connection``, which sets its state up)."""

    _place: Callable[[str], Placer | None] | None
    _refuse: Refuse | None
    _read_timeout: bool  # set while a slot waits for a message's bytes
    _max_message: int
    _budget: ByteBudget
    _decoder: HeaderDecoder
    _recv_window: int

    def _dispatch(self, stream: Stream) -> None:
        raise NotImplementedError

    def _update_read_timeout(self) -> None:
        raise NotImplementedError

    def _tick(self) -> float:
        raise NotImplementedError

    def _header_block_too_long(self) -> H2ProtocolError:
        limit = self._limits.max_header_block
        return H2ProtocolError(ENHANCE_YOUR_CALM, f"a header block over {limit} bytes")

    def _frame(self) -> None:
        head = self._reader.exactly(9)
        length = (head[0] << 16) | (head[1] << 8) | head[2]
        kind, flags = head[3], head[4]
        stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        if length > OUR_MAX_FRAME:
            raise H2ProtocolError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
        # A control frame's length is checked before any of it is read: nothing is sized by the client.
        if kind in _FIXED_LENGTH and length != _FIXED_LENGTH[kind]:
            raise H2ProtocolError(FRAME_SIZE_ERROR, f"a malformed frame of type {kind} ({length} bytes)")
        if kind == SETTINGS and length > _MAX_SETTINGS_BYTES:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"a SETTINGS frame of {length} bytes")
        if kind == DATA:
            if not length and not flags & END_STREAM:
                self._glitch("empty DATA")
            self._data(length, flags, stream_id)
        elif kind == HEADERS:
            if length > self._limits.max_header_block:  # refused before it is read or decoded
                raise self._header_block_too_long()
            self._headers(self._reader.payload(length), flags, stream_id)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._glitch("SETTINGS")
            self._settings(self._reader.payload(length), flags, stream_id)
        elif kind == WINDOW_UPDATE:
            self._window_update(self._reader.payload(length), stream_id)
        elif kind == PING:
            self._ping(self._reader.payload(length), flags, stream_id)
        elif kind == RST_STREAM:
            self._reader.payload(length)
            if length != 4 or not stream_id:
                raise H2ProtocolError(PROTOCOL_ERROR, "a malformed RST_STREAM")
            self._glitch("RST_STREAM")
            with self._flow:
                stream = self._streams.pop(stream_id, None)
                if stream is not None:
                    stream.reset = True
                    if not stream.dispatched:
                        stream.release()
                    self._flow.notify_all()
            if stream is not None and self._read_timeout:
                self._update_read_timeout()
        elif kind == GOAWAY:
            self._reader.skip(length)  # its debug data is not kept
        elif kind == PRIORITY:
            self._glitch("PRIORITY")
            self._reader.payload(length)
        elif kind in (PUSH_PROMISE, CONTINUATION):
            raise H2ProtocolError(PROTOCOL_ERROR, f"an unexpected frame of type {kind}")
        else:
            self._glitch(f"frame type {kind}")
            self._reader.skip(length)  # unknown frame types are ignored

    def _data(self, length: int, flags: int, stream_id: int) -> None:
        if not stream_id:
            raise H2ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        pad = 0
        if flags & PADDED:
            if not length:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "a padded DATA frame without its pad length")
            pad = self._reader.exactly(1)[0]
            if pad > length - 1:
                raise H2ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
        count = length - pad - (1 if flags & PADDED else 0)
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise H2ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._reader.skip(count)  # a stream already answered and closed: dropped
        elif stream.ended:
            raise H2ProtocolError(PROTOCOL_ERROR, f"DATA after the end of stream {stream_id}")
        else:
            self._receive(stream, count)
        self._reader.skip(pad)
        self._window_used(length)
        if stream is None:
            return
        if flags & END_STREAM:
            self._end_stream(stream)
        elif not flags & PADDED and stream.error is None and self._read_timeout and self._reader.reads_runs():
            self._data_run()  # only while a slot waits for a message (the read timeout is set then)

    def _receive(self, stream: Stream, count: int) -> None:
        """``count`` bytes of the stream's DATA into its message; a slot's wait and an early error seen to."""
        placing = stream.placing()
        stream.receive(self._reader, count)
        if stream.placing() != placing:
            if not placing:  # a slot now waits for the message: at the slot's pace, not the client's
                stream.place_started = time.monotonic()
            self._update_read_timeout()
        if stream.error is not None and not stream.dispatched:
            self._dispatch(stream)  # answered now, so that the client stops sending

    def _data_run(self) -> None:
        """The next plain DATA frames of the streams whose messages go into slots, read in one run straight
        into their slots (the C reader), their frames interleaved or not.

        The run lasts no longer than the read timeout's tick, nor past the first slot's time for its
        message: then the connection's loop looks at its slots and output as after any frame.
        Output waiting on the client is written first (no run while it waits)."""
        if self._parked or self._tail:
            return
        with self._flow:
            placing = [s for s in self._streams.values() if not s.ended and s.placing()]
        streams: list[Stream] = []
        targets: list[tuple[int, memoryview]] = []
        deadline = time.monotonic() + self._tick()
        for stream in placing[:_MAX_RUN_STREAMS]:
            view = stream.placed_view()
            if view is not None:
                streams.append(stream)
                targets.append((stream.id, view))
                slot_time = self._limits.slot_time(stream.message_length(), stream.slot_busy())
                deadline = min(deadline, stream.place_started + slot_time)
        if not targets:
            return
        placed, consumed, rest, last = self._reader.data_run(targets, deadline)
        del targets
        if not consumed:
            return
        for stream, n in zip(streams, placed):
            if n:
                stream.placed(n)
        self._window_used(consumed)
        if rest:  # the socket stopped within a frame: its rest is read as any DATA is
            self._receive(streams[last], rest)
        if any(not stream.placing() for stream in streams):  # messages all in their slots
            self._update_read_timeout()

    def _window_used(self, length: int) -> None:
        """``length`` bytes of DATA payload arrived: the connection's receive window is opened again
        once half of it is used."""
        self._recv_window -= length
        if self._recv_window < MAX_WINDOW // 2:
            self._send(
                [frame_header(4, WINDOW_UPDATE, 0, 0), (MAX_WINDOW - self._recv_window).to_bytes(4, "big")]
            )
            self._recv_window = MAX_WINDOW

    def _headers(self, payload: bytes, flags: int, stream_id: int) -> None:
        if not stream_id or not stream_id % 2:
            raise H2ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "a padded HEADERS frame without its pad length")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise H2ProtocolError(PROTOCOL_ERROR, "a malformed HEADERS frame")
        block = bytearray(payload[start:end])
        while not flags & END_HEADERS:  # CONTINUATION frames follow, and nothing else
            head = self._reader.exactly(9)
            length = (head[0] << 16) | (head[1] << 8) | head[2]
            if head[3] != CONTINUATION or int.from_bytes(head[5:9], "big") & 0x7FFFFFFF != stream_id:
                raise H2ProtocolError(PROTOCOL_ERROR, "a header block interrupted")
            if len(block) + length > self._limits.max_header_block:
                raise self._header_block_too_long()
            if not length and not head[4] & END_HEADERS:
                self._glitch("empty CONTINUATION")
            block += self._reader.payload(length)
            flags = head[4] | (flags & END_STREAM)
        try:
            headers = self._decoder.decode(bytes(block))
        except Exception as e:  # hpack's errors
            raise H2ProtocolError(COMPRESSION_ERROR, f"an unreadable header block: {e}") from e
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client: the end of its side
            if not flags & END_STREAM:
                raise H2ProtocolError(PROTOCOL_ERROR, "trailers without END_STREAM")
            self._end_stream(stream)
            return
        if stream_id <= self._last_stream:
            raise H2ProtocolError(PROTOCOL_ERROR, f"HEADERS on closed stream {stream_id}")
        if self._final_goaway:  # past the last stream the GOAWAY named: never run (safe to retry)
            self._send_reset(stream_id, REFUSED_STREAM)
            return
        self._last_stream = stream_id
        path = next((v for k, v in headers if k == ":path"), "")
        placer = self._place(path) if self._place is not None else None
        with self._flow:
            stream = Stream(
                stream_id, headers, self._peer_initial_window, self._max_message, placer, self._budget
            )
            refused = len(self._streams) >= self._limits.max_streams
            if not refused:
                self._streams[stream_id] = stream
        if refused:
            self._send_reset(stream_id, REFUSED_STREAM)
            return
        if self._refuse is not None:
            stream.error = self._refuse(path, stream.metadata)
            if stream.error is not None:
                self._dispatch(stream)
        if flags & END_STREAM:
            self._end_stream(stream)

    def _end_stream(self, stream: Stream) -> None:
        with self._flow:
            stream.ended = True
            if stream.dispatched:  # answered early (an error)
                if stream.done:
                    self._streams.pop(stream.id, None)
                return
        self._dispatch(stream)
