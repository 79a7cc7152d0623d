"""A gRPC call on the front door's HTTP/2 server: its stream, and the call as its handler sees it.

A :class:`Stream` holds one call's headers and metadata, its request message as
its DATA arrives (in memory, or read straight into a slot by the method's placer)
and its send window; a :class:`Call` is what the call's handler gets: the
method, metadata and request message, and ``respond`` and ``abort`` to answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from ray_triton_shm._private.serve.http2.grpc_message import (
    MessageBuffer,
    PlacedMessage,
    Placement,
    Placer,
)
from ray_triton_shm._private.serve.http2.h2_reader import FrameReader
from ray_triton_shm._private.serve.http2.h2_wire import CallError, StreamGone
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget, inflate


def metadata_of(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A call's metadata: its headers other than HTTP/2's pseudo-headers and gRPC's own."""
    return [
        (k, v)
        for k, v in headers
        if not k.startswith((":", "grpc-")) and k not in ("content-type", "te", "user-agent")
    ]


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

    def placed_view(self) -> memoryview | None:
        """Where the message's next bytes go in its slot, while one is held for them; else ``None``."""
        if self.error is None and isinstance(self.message, PlacedMessage):
            return self.message.writable()
        return None

    def placed(self, n: int) -> None:
        """``n`` bytes were written at the start of :meth:`placed_view`'s view."""
        if isinstance(self.message, PlacedMessage):
            self.message.filled(n)

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
        return inflated(data, self.header("grpc-encoding"), self.max_message)

    def header(self, name: str) -> str | None:
        return header_of(self.headers, name)


def header_of(headers: Sequence[tuple[str, str]], name: str) -> str | None:
    """The value of header ``name`` (the first, if several), or ``None``."""
    for key, value in headers:
        if key == name:
            return value
    return None


def inflated(data: bytes | bytearray, encoding: str | None, max_message: int) -> bytes:
    """A compressed request message, inflated (``encoding``: its ``grpc-encoding``).

    Raises:
        CallError: An encoding this server does not read (``UNIMPLEMENTED``), or a message that
            does not inflate, or inflates past ``max_message`` (``INTERNAL``).
    """
    encoding = encoding or "identity"
    if encoding not in ("gzip", "deflate"):
        raise CallError(
            "UNIMPLEMENTED",
            f"the request message is compressed with {encoding!r}; this server reads gzip and deflate",
        )
    try:
        return inflate(bytes(data), encoding, max_message)
    except Exception as e:
        raise CallError("INTERNAL", f"the request message cannot be inflated: {e}") from e


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
