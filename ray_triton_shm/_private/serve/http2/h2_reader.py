"""The front door's HTTP/2 socket reader: buffered reads, with large reads straight into their target.

A connection's frames are read through one :class:`FrameReader`: frame heads,
control frames and header blocks from its buffer, a large DATA payload straight
into the buffer (or shared-memory slot) its request message goes to. A read into
a slot that the client does not feed in time stalls
(:class:`~ray_triton_shm._private.serve.http2.grpc_message.Stalled`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from ray_triton_shm._private.serve.http2.grpc_message import Stalled

try:  # runs of DATA frames read in C (setup.py builds it; without it frames are read one at a time)
    from ray_triton_shm._private.serve.http2 import _h2_data
except ImportError:  # pragma: no cover - no C compiler at install time
    _h2_data = None
from ray_triton_shm._private.serve.http2.h2_wire import PLACED_CHUNK, READ_AHEAD, READER_BUFFER


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

    @staticmethod
    def reads_runs() -> bool:
        """Whether :meth:`data_run` reads runs of frames (the C extension is built)."""
        return _h2_data is not None

    def data_run(
        self, targets: list[tuple[int, memoryview]], deadline: float
    ) -> tuple[list[int], int, int, int]:
        """Read the next plain DATA frames of the streams of ``targets`` into their views, as far as they
        come at once.

        ``targets`` holds ``(stream id, view)`` pairs; each frame's payload goes at the start of
        what is left of its stream's view. The run ends, the frame left unread, at the first
        frame that is not a plain DATA frame of one of those streams (another type or stream,
        END_STREAM, padding, empty) or whose payload does not fit what is left of its view,
        when the socket gives no more bytes (its receive timeout, or the end), and before a
        frame once ``time.monotonic()`` passes ``deadline``; only :meth:`reads_runs` readers
        read any.

        Returns:
            ``(placed, consumed, rest, last)``: the bytes written into each view (in the order
            of ``targets``); the payload lengths of the frames begun (for the receive window);
            how much of the last frame's payload is still to be read (``0`` unless the socket
            stopped in the middle of a frame; the caller reads that rest); and the index in
            ``targets`` of that frame's stream (``-1``: no frame begun).
        """
        if _h2_data is None:
            return [0] * len(targets), 0, 0, -1
        held = self._end - self._start
        self._start, self._end, placed, consumed, rest, last = _h2_data.read_data_frames(
            self._sock.fileno(), self._buf, self._start, self._end, targets, deadline
        )
        if consumed or self._end - self._start > held:
            self.last_read = time.monotonic()
        return placed, consumed, rest, last

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
