"""Where a gRPC request message's bytes go as they arrive: a buffer, or partly a shared-memory slot.

A message is read into a :class:`MessageBuffer` unless the call's method has a
*placer* (``ModelInfer`` on the front door). Then a :class:`PlacedMessage`
first reads the message's head (its first :data:`HEAD_BYTES`) and asks the
placer where the rest goes: a :class:`Placement` lists the byte strings the
rest must be (each raw input's field key and length) and the views it fills
(the inputs' regions in a leased slot), so the tensors are read from the
socket straight into the slot. Bytes that differ from what the placement
expects turn the message back into a plain buffer, the bytes read so far
copied into it and the slot given back: the call then sees the message as
it was sent, and gets the answer any other message gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget

HEAD_BYTES = 4096
"""Bytes of a message read before its placer is asked (a ``ModelInfer`` head is a few hundred)."""


class Stalled(Exception):
    """A read for a slot waited past its stall time; ``taken`` bytes of it had arrived (and are in place)."""

    def __init__(self, taken: int) -> None:
        super().__init__(taken)
        self.taken = taken


class Source(Protocol):
    """What a message reads from: the connection's frame reader (``placed``: the bytes are for a slot)."""

    def exactly(self, n: int, placed: bool = False) -> bytes: ...

    def into(self, target: memoryview, placed: bool = False) -> None: ...


FIRST_BUFFER = 64 * 1024
"""What a message buffer holds before any of its bytes arrive (it grows as they do)."""


class MessageBuffer:
    """A message of ``length`` bytes read into one buffer, the first ``len(start)`` of them ``start``.

    The buffer is never sized by the announced ``length`` alone: it starts at
    :data:`FIRST_BUFFER` (or ``start``) and at most doubles each time it fills, so
    it holds at most twice the bytes that have arrived (and never more than ``length``).
    Each growth is taken from ``budget`` first (:class:`OverBudget` when it has too little).
    """

    def __init__(self, length: int, start: bytes | bytearray = b"", budget: ByteBudget | None = None) -> None:
        self.length = length
        self._budget = budget
        self.charged = 0
        self._charge(len(start))
        self.data = bytearray(start)
        self.filled = len(start)
        if len(self.data) < length:
            self._grow(FIRST_BUFFER)

    def _charge(self, n: int) -> None:
        if self._budget is not None and n:
            self._budget.take(n)
            self.charged += n

    def _grow(self, want: int) -> None:
        size = min(self.length, max(want, 2 * len(self.data)))
        if size <= len(self.data):
            return
        spares = self._budget.spares if self._budget is not None else None
        spare = spares.take(size, min(self.length, 2 * size)) if spares is not None else None
        if spare is None:  # charged before it is allocated: grown in place
            self._charge(size - len(self.data))
            self.data += bytes(size - len(self.data))
            return
        try:
            self._charge(len(spare) - len(self.data))
        except OverBudget:
            spares.give(spare)  # type: ignore[union-attr]
            raise
        spare[: self.filled] = memoryview(self.data)[: self.filled]
        old, self.data = self.data, spare
        del spare
        spares.give(old)  # type: ignore[union-attr]

    def free(self) -> None:
        """Drop the bytes and give their memory back to the budget (idempotent).

        The buffer is kept for another message (see :class:`SpareBuffers`) unless a view of it
        is still alive.
        """
        data, self.data = self.data, bytearray()
        if self._budget is not None:
            if self.charged:
                self._budget.give(self.charged)
            self._budget.spares.give(data)
        self.charged = 0

    def full(self) -> bool:
        return self.filled == self.length

    def take(self, source: Source, count: int) -> int:
        """Read up to ``count`` of the message's bytes from ``source``; returns how many."""
        n = min(count, self.length - self.filled)
        if self.filled + n > len(self.data):
            self._grow(self.filled + min(n, len(self.data) or FIRST_BUFFER))
            n = min(n, len(self.data) - self.filled)
        source.into(memoryview(self.data)[self.filled : self.filled + n])
        self.filled += n
        return n


class Placement:
    """Where the rest of a message goes, after its ``head`` (the bytes before the first placed part).

    Args:
        lease: The slot the views are in (given back by :meth:`release`).
        head: The message's bytes before ``parts``.
        parts: In order: byte strings the message must go on with, and writable views it fills.
        request: What the placer made of the head (for the call).
        busy: Whether another call waits for a slot like this one now (then a slow client's
            bytes wait less for it); ``None``: never.
    """

    def __init__(
        self,
        lease: Any,
        head: bytes,
        parts: list[bytes | memoryview],
        request: Any,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self.lease = lease
        self.head = head
        self.parts = parts
        self.request = request
        self._busy = busy
        self._index = 0
        self._offset = 0

    def busy(self) -> bool:
        """Whether another call waits for a slot like this one now."""
        return self._busy is not None and self._busy()

    def length(self) -> int:
        """The whole message's length as placed."""
        return len(self.head) + sum(len(p) for p in self.parts)

    def full(self) -> bool:
        return self._index == len(self.parts)

    def take(self, source: Source, count: int) -> int:
        """Read up to ``count`` bytes from ``source`` into place; returns how many.

        Raises:
            Mismatch: The message differs from what was expected (with the bytes read meanwhile).
            Stalled: The client stopped sending at full speed (with the bytes placed meanwhile).
        """
        done = 0
        while done < count and self._index < len(self.parts):
            part = self.parts[self._index]
            n = min(count - done, len(part) - self._offset)
            if isinstance(part, memoryview):
                try:
                    source.into(part[self._offset : self._offset + n], placed=True)
                except Stalled as e:
                    self._advance(e.taken)
                    raise Stalled(done + e.taken) from e
            else:
                try:
                    got = source.exactly(n, placed=True)
                except Stalled as e:
                    raise Stalled(done) from e
                if got != part[self._offset : self._offset + n]:
                    raise Mismatch(done, got)
            done += n
            self._advance(n)
        return done

    def take_bytes(self, data: bytes) -> int:
        """Place ``data`` (bytes already read); returns how many were taken.

        Raises:
            Mismatch: As :meth:`take`.
        """
        return self.take(_BytesSource(data), len(data))

    def writable(self) -> memoryview | None:
        """The rest of the part being filled, if it is a view (``None``: bytes to match, or full)."""
        if self._index < len(self.parts):
            part = self.parts[self._index]
            if isinstance(part, memoryview):
                return part[self._offset :]
        return None

    def filled(self, n: int) -> None:
        """``n`` bytes were written at the start of :meth:`writable`'s view."""
        self._advance(n)

    def rest(self) -> list[bytes | memoryview]:
        """The parts still to fill or match, the one begun from where it stands."""
        parts = list(self.parts[self._index :])
        if parts and self._offset:
            parts[0] = parts[0][self._offset :]
        return parts

    def complete(self) -> None:
        """Every part left was filled or matched (in place, by whoever :meth:`rest` was given to)."""
        self._index, self._offset = len(self.parts), 0

    def _advance(self, n: int) -> None:
        self._offset += n
        while self._index < len(self.parts) and self._offset == len(self.parts[self._index]):
            self._index += 1
            self._offset = 0

    def read_so_far(self) -> bytearray:
        """The message's bytes placed so far, head included (a copy)."""
        out = bytearray(self.head)
        for part in self.parts[: self._index]:
            out += part
        if self._index < len(self.parts):
            out += self.parts[self._index][: self._offset]
        return out

    def release(self) -> None:
        """Drop the views and give the slot back (idempotent)."""
        self.parts = []
        self.lease.release()


class Mismatch(Exception):
    """Bytes that differ from a placement's: ``taken`` bytes of this read went into place, then ``got``."""

    def __init__(self, taken: int, got: bytes) -> None:
        super().__init__(taken, got)
        self.taken = taken
        self.got = got


class _BytesSource:
    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def exactly(self, n: int, placed: bool = False) -> bytes:
        out = bytes(self._view[self._pos : self._pos + n])
        self._pos += n
        return out

    def into(self, target: memoryview, placed: bool = False) -> None:
        n = len(target)
        target[:] = self._view[self._pos : self._pos + n]
        self._pos += n


Placer = Callable[[bytes, int], "Placement | None"]
"""Given a message's head and its length: where the rest goes, or ``None`` (a plain buffer then)."""


class PlacedMessage:
    """A message whose head is read first; then the rest goes where the placer says, or into a buffer.

    Args:
        length: The message's length.
        placer: See :data:`Placer`; it must not block.
    """

    def __init__(self, length: int, placer: Placer, budget: ByteBudget | None = None) -> None:
        self.length = length
        self._placer = placer
        self._budget = budget
        self._head = bytearray()
        self.placement: Placement | None = None
        self.buffer: MessageBuffer | None = None

    def full(self) -> bool:
        if self.placement is not None:
            return self.placement.full()
        if self.buffer is not None:
            return self.buffer.full()
        return False

    def placing(self) -> bool:
        """Whether a slot is held for the message while its bytes still arrive."""
        return self.placement is not None and not self.placement.full()

    def take(self, source: Source, count: int) -> int:
        """Read up to ``count`` of the message's bytes from ``source``; returns how many."""
        if self.buffer is not None:
            return self.buffer.take(source, count)
        if self.placement is not None:
            try:
                return self.placement.take(source, count)
            except Mismatch as e:
                self._unplace(e.got)
                return e.taken + len(e.got)
            except Stalled as e:  # the rest is read into memory; the slot goes back now
                self._unplace(b"")
                return e.taken
        n = min(count, min(self.length, HEAD_BYTES) - len(self._head))
        self._head += source.exactly(n)
        if len(self._head) == min(self.length, HEAD_BYTES):
            self._place()
        return n

    def _place(self) -> None:
        head = bytes(self._head)
        placement = self._placer(head, self.length)
        if placement is None or placement.length() != self.length:
            if placement is not None:
                placement.release()
            self._to_buffer(head)
            return
        try:
            placement.take_bytes(head[len(placement.head) :])
        except Mismatch:
            placement.release()
            self._to_buffer(head)
            return
        self.placement = placement

    def writable(self) -> memoryview | None:
        """Where the message's next bytes go in its slot (see :meth:`Placement.writable`), or ``None``."""
        return self.placement.writable() if self.placing() else None

    def filled(self, n: int) -> None:
        """``n`` bytes were written at the start of :meth:`writable`'s view."""
        if self.placement is not None:
            self.placement.filled(n)

    def to_memory(self) -> None:
        """Move a message being placed into a buffer of its own, and give its slot back now."""
        if self.placing():
            self._unplace(b"")

    def _unplace(self, got: bytes) -> None:
        placement, self.placement = self.placement, None
        if placement is not None:
            so_far = placement.read_so_far() + got
            placement.release()
            self._to_buffer(so_far)

    def _to_buffer(self, data: bytes | bytearray) -> None:
        self.buffer = MessageBuffer(self.length, data, self._budget)

    def release(self) -> None:
        """Give back the slot of a placement the call did not take, and the buffer's memory (idempotent)."""
        if self.placement is not None:
            self.placement.release()
        if self.buffer is not None:
            self.buffer.free()

    def message(self) -> bytearray:
        """The whole message's bytes (copied out of place if it was placed; the slot goes back then).

        Raises:
            OverBudget: A placed message's copy does not fit the budget.
        """
        placement, self.placement = self.placement, None
        if placement is not None:
            data = placement.read_so_far()
            placement.release()
            self._to_buffer(data)
        if self.buffer is None:
            raise ValueError("the message is not complete")
        return self.buffer.data
