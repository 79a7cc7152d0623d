"""A lean HTTP/1.1 server for KServe v2: a thread per busy connection, idle ones parked, bodies read in place.

The front door's HTTP half (see :mod:`ray_triton_shm._private.serve.door.frontdoor`). It
speaks just what KServe v2 clients send: a request line and headers, a body of
``Content-Length`` bytes (or chunked), keep-alive connections (HTTP/1.1 by
default, HTTP/1.0 on ``Connection: keep-alive``), ``Expect: 100-continue``.
A handler gets the parsed head (:mod:`~ray_triton_shm._private.serve.http1.head`) and a
:class:`~ray_triton_shm._private.serve.http1.body.Body` it reads from: into any
buffer it likes (``readinto``, straight from the socket into a shared-memory
slot), or whole (``read_all``). It answers with :meth:`Connection.respond`,
whose body parts (views of a slot, say) go to the socket as they are
(``sendmsg``), without being joined first.

It reads requests strictly (RFC 9112; heads through llhttp, see
:mod:`~ray_triton_shm._private.serve.http1.head`): every line ends with CRLF; no obsolete
line folding; header names are tokens and values hold no control characters;
``Content-Length`` with ``Transfer-Encoding``, a transfer coding other than one
``chunked``, conflicting ``Content-Length`` values and chunk sizes that are not
plain hex are refused, and the connection closed after the answer (400, or 501
for a transfer coding it does not implement). What it keeps in memory grows
with the bytes that arrive, never with the sizes a client announces; how long
a client may take is bounded by
:class:`~ray_triton_shm._private.serve.http1.timing.HttpTimeouts`.

The listening socket has ``SO_REUSEPORT``: every replica of an app on a node
binds the same port and the kernel spreads the connections among them. A
connection idle between requests waits in the listener's selector, without a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from ray_triton_shm._private.serve.http1.body import RECV_BYTES, Body
from ray_triton_shm._private.serve.http1.head import (
    MAX_HEAD_BYTES,
    HttpParseError,
    HttpTimeoutError,
    RequestHead,
    parse_head,
    response_head,
)
from ray_triton_shm._private.serve.http1.timing import BodyClock, ConnectionGone, Deadline, HttpTimeouts
from ray_triton_shm._private.serve.net.bounded import ByteBudget, OverBudget
from ray_triton_shm._private.serve.net.listener import (
    IDLE_LINGER_S,
    IOV_BATCH,
    MAX_OPEN,
    TcpListener,
    consumed,
)

logger = logging.getLogger(__name__)


Handler = Callable[["Connection", RequestHead, Body], None]

HeadParser = Callable[[memoryview], RequestHead]
"""Reads a request head (ending with its blank line); raises :class:`HttpParseError` when malformed."""


class Connection:
    """One client connection: reads requests one after another and hands each to the handler.

    Args:
        sock: The connected socket.
        handler: Called for each request.
        timeouts: How long the client may take.
        draining: Whether the server is draining: each answer then ends its
            connection (``Connection: close``).
        parse: Reads each request head (:func:`~ray_triton_shm._private.serve.http1.head.parse_head`).
        body_budget: What request bodies read into memory are taken from (the listener's).
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        timeouts: HttpTimeouts | None = None,
        draining: Callable[[], bool] | None = None,
        parse: HeadParser = parse_head,
        body_budget: ByteBudget | None = None,
    ) -> None:
        self.sock = sock
        self._body_budget = body_budget
        self._draining = draining
        self._handler = handler
        self._parse = parse
        self.timeouts = timeouts or HttpTimeouts()
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes lie in _buf[_start:_end]
        self._end = 0
        self._send_deadline = 0.0
        self.keep_alive = True
        self.status = 0
        """The status of the last answer begun (0: none yet)."""
        self._head_only = False  # the request is HEAD: its answer carries no content

    # -- reading ----------------------------------------------------------
    def _recv(self, view: memoryview, clock: Deadline | BodyClock, stall_s: float | None = None) -> int:
        """One ``recv_into``, waiting no longer than ``clock`` allows; 0 when ``stall_s`` passed first.

        Raises:
            HttpTimeoutError: ``clock`` ran out (or its own ``late`` error).
            ConnectionGone: The peer closed the connection.
        """
        left = clock.left()
        if left <= 0:
            raise clock.late()
        wait = left if stall_s is None else min(left, stall_s)
        self.sock.settimeout(wait)
        began = time.monotonic()
        try:
            got = self.sock.recv_into(view)
        except TimeoutError:
            clock.spent(time.monotonic() - began, 0)
            if stall_s is not None and stall_s < left:
                return 0
            raise clock.late() from None
        if not got:
            raise ConnectionGone()
        clock.spent(time.monotonic() - began, got)
        return got

    def _fill(self, clock: Deadline | BodyClock) -> None:
        """Read more into the buffer (moving unread bytes to its start first)."""
        if self._start:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        if self._end == len(self._buf):
            raise HttpParseError("request header fields too large", 431)
        self._end += self._recv(self._view[self._end :], clock)

    def read_exactly(
        self,
        target: memoryview,
        clock: Deadline | BodyClock,
        stall_s: Callable[[], float] | None = None,
        tick_s: float | None = None,
    ) -> int:
        """Fill ``target``: first from the buffer, then straight from the socket.

        Args:
            target: Where the bytes go.
            clock: The body's clock.
            stall_s: How long after the read began it stops, filled or not (a client
                trickling a byte now and then runs out of it as one that sends nothing);
                asked again every ``tick_s`` while the read waits, as the time allowed
                may shrink meanwhile.
            tick_s: How often ``stall_s`` is asked (``None``: only when bytes come).

        Returns:
            ``len(target)``, or fewer when ``stall_s`` passed first.

        Raises:
            HttpTimeoutError: ``clock`` ran out.
            ConnectionGone: The peer closed first.
        """
        have = min(self._end - self._start, len(target))
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        began = time.monotonic()
        while have < len(target):
            wait = None
            if stall_s is not None:
                wait = began + stall_s() - time.monotonic()
                if wait <= 0:
                    break
                if tick_s is not None:
                    wait = min(wait, tick_s)
            have += self._recv(target[have:], clock, wait)  # 0: the wait passed first; look again
        return have

    def read_line(self, clock: Deadline | BodyClock, limit: int) -> bytes:
        """The next line of a chunked body, without its CRLF.

        Raises:
            HttpParseError: A bare LF or CR, or a line over ``limit`` bytes.
            HttpTimeoutError: ``clock`` ran out.
            ConnectionGone: The peer closed first.
        """
        while True:
            at = self._buf.find(b"\n", self._start, self._end)
            if at >= 0:
                if at == self._start or self._buf[at - 1] != 0x0D:
                    raise HttpParseError("bare LF in a chunked body (lines end with CRLF)")
                line = bytes(self._buf[self._start : at - 1])
                if len(line) > limit:
                    raise HttpParseError(f"chunked body line over {limit} bytes")
                if b"\r" in line:
                    raise HttpParseError("bare CR in a chunked body")
                self._start = at + 1
                return line
            if self._end - self._start > limit + 1:
                raise HttpParseError(f"chunked body line over {limit} bytes")
            self._fill(clock)

    def read_head(self) -> RequestHead | None:
        """The next request's head; ``None`` when the peer closed or idled between requests.

        Raises:
            HttpParseError: Not a valid request head; :class:`HttpTimeoutError`
                when it did not arrive within ``timeouts.head_s``.
            ConnectionGone: The peer closed mid-head.
        """
        if self._start == self._end:
            try:
                self._fill(Deadline(self.timeouts.idle_s, ConnectionGone))
            except ConnectionGone:
                return None
        head_s = self.timeouts.head_s
        clock = Deadline(head_s, lambda: HttpTimeoutError(f"request head not received within {head_s:g} s"))
        scanned = 0  # bytes after _start already checked for a bare LF
        while True:
            at = self._buf.find(b"\r\n\r\n", self._start, self._end)
            if at >= 0:
                head = self._parse(self._view[self._start : at + 4])
                self._start = at + 4
                return head
            lf = self._buf.find(b"\n", self._start + scanned, self._end)
            while lf >= 0:
                if lf == self._start or self._buf[lf - 1] != 0x0D:
                    raise HttpParseError("bare LF in the request head (lines end with CRLF)")
                lf = self._buf.find(b"\n", lf + 1, self._end)
            scanned = self._end - self._start
            if scanned >= MAX_HEAD_BYTES:
                raise HttpParseError("request header fields too large", 431)
            self._fill(clock)

    # -- writing ----------------------------------------------------------
    def send_parts(
        self, parts: Sequence[bytes | memoryview], stall_s: float | None = None
    ) -> list[memoryview]:
        """Write every part, in order, without joining them (``sendmsg``), by the answer's deadline.

        Args:
            parts: What to write.
            stall_s: Stop when the client takes nothing for this long.

        Returns:
            What is left to write: nothing, or (with ``stall_s``) the parts the
            client did not take, still views of ``parts``.

        Raises:
            ConnectionGone: The answer's deadline (``timeouts.send_s`` from
                :meth:`respond`) passed, or the peer is gone.
        """
        if self._send_deadline <= time.monotonic():
            self._send_deadline = time.monotonic() + self.timeouts.send_s
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        first = 0
        while first < len(views):
            left = self._send_deadline - time.monotonic()
            if left <= 0:
                raise ConnectionGone(f"the answer was not taken within {self.timeouts.send_s:g} s")
            wait = left if stall_s is None else min(left, stall_s)
            self.sock.settimeout(wait)
            try:
                sent = self.sock.sendmsg(views[first : first + IOV_BATCH])
            except TimeoutError:
                if stall_s is not None and stall_s < left:
                    return views[first:]
                raise ConnectionGone(f"the answer was not taken within {self.timeouts.send_s:g} s") from None
            except OSError as e:  # reset or closed by the client
                raise ConnectionGone(f"the client went while its answer was sent: {e}") from e
            first = consumed(views, first, sent)
        return []

    def respond(
        self,
        status: int,
        headers: Sequence[tuple[str, str]],
        parts: Sequence[bytes | memoryview],
        stall_s: float | None = None,
        hold: ByteBudget | None = None,
    ) -> bytes:
        """Answer the current request: status, headers and the body ``parts``.

        The whole answer must be written within ``timeouts.send_s``. The answer to a
        ``HEAD`` request is its head alone, ``content-length`` that of ``parts``
        (RFC 9110, 9.3.2; RFC 9112, 6.3: the client reads no content after it).

        Args:
            status: The status code.
            headers: Headers besides ``content-length`` and ``connection``.
            parts: The body, in parts written as they are.
            stall_s: When the client takes nothing for this long, stop and
                return the rest, copied (``parts`` may be released then).
            hold: The rest is copied only if this budget has room for it (give it
                back once :meth:`send_rest` is done); else the connection ends.

        Returns:
            ``b""`` when all was written, else the rest of the answer: write it
            with :meth:`send_rest`.

        Raises:
            ConnectionGone: The deadline passed, the peer is gone, or an answer
                not taken has no room in ``hold``.
        """
        self._send_deadline = time.monotonic() + self.timeouts.send_s
        self.status = status
        if self._draining is not None and self._draining():
            self.keep_alive = False
        length = sum(memoryview(p).nbytes for p in parts)
        head = response_head(status, headers, length, self.keep_alive)
        rest = self.send_parts([head] if self._head_only else [head, *parts], stall_s)
        if rest and hold is not None:
            try:
                hold.take(sum(view.nbytes for view in rest))
            except OverBudget as e:
                self.keep_alive = False
                raise ConnectionGone(f"an answer not taken, and no room to hold it ({e.what})") from None
        return b"".join(rest)

    def send_rest(self, rest: bytes) -> None:
        """Write what :meth:`respond` returned, by the same answer's deadline.

        Raises:
            ConnectionGone: The deadline passed, or the peer is gone.
        """
        if rest:
            if self._send_deadline <= time.monotonic():
                raise ConnectionGone(f"the answer was not taken within {self.timeouts.send_s:g} s")
            self.send_parts([rest])

    # -- serving ----------------------------------------------------------
    def serve(self) -> float | None:
        """Serve requests while they come.

        Returns:
            ``None`` when the connection is over (the peer closed, a request was refused
            or too slow, the socket was shut: it is closed then), or, when it is idle
            between requests, how long it may stay so (``timeouts.idle_s``): the caller
            waits for its next bytes without a thread, then calls ``serve`` again.
        """
        try:
            while self.keep_alive:
                if self._start == self._end and not select.select([self.sock], [], [], IDLE_LINGER_S)[0]:
                    return self.timeouts.idle_s
                try:
                    self._head_only = False
                    head = self.read_head()
                    if head is None:
                        return
                    self.keep_alive = head.keep_alive
                    self._head_only = head.method == "HEAD"
                    body = Body(self, head, self._body_budget)
                    try:
                        self._handler(self, head, body)
                    finally:
                        body.release()
                except HttpParseError as e:  # the framing is lost: answer, then close
                    self.keep_alive = False
                    self.respond(e.status, [("content-type", "application/json")], [_error_json(str(e))])
                    self._linger()
                    return
            self._linger()
        except (ConnectionGone, OSError):
            pass
        with contextlib.suppress(OSError):
            self.sock.close()
        return None

    def _linger(self, limit_s: float = 1.0, limit_bytes: int = 1 << 20) -> None:
        """Close gently after an answer the client may not have finished sending for.

        The write side is shut first and what the client still sends is read and
        dropped (for ``limit_s`` in all): closing with unread data would reset
        the connection and could lose the answer before the client reads it.
        """
        self.sock.shutdown(socket.SHUT_WR)
        clock = Deadline(limit_s, ConnectionGone)
        dropped = 0
        with contextlib.suppress(OSError, ConnectionGone):
            while dropped < limit_bytes:
                dropped += self._recv(self._view, clock)


def _error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class HttpListener(TcpListener):
    """A listening socket: each connection served in a thread while it has
    requests, and parked in the listener's selector (no thread) while it is idle between them.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Called for every request, in the connection's thread.
        max_connections: Connections served at once; idle ones wait without a thread.
        max_open: Connections open at once, idle ones included.
        timeouts: How long a client may take (heads, bodies, idle waits, answers).
        listening: A listening socket to accept from instead of binding one (see
            :class:`~ray_triton_shm._private.serve.net.listener.TcpListener`).
        parse: Reads each request head (see :class:`Connection`).
        max_buffered_bytes: Bytes of request bodies all connections may hold in memory at
            once (a body that does not fit is answered 503); ``None``: no bound but theirs.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        max_connections: int = 256,
        timeouts: HttpTimeouts | None = None,
        listening: socket.socket | None = None,
        parse: HeadParser = parse_head,
        max_open: int = MAX_OPEN,
        max_buffered_bytes: int | None = None,
    ) -> None:
        chosen = timeouts or HttpTimeouts()
        self.buffered = (
            None
            if max_buffered_bytes is None
            else ByteBudget(max_buffered_bytes, "the front door's http_max_buffered_bytes")
        )
        connections: dict[socket.socket, Connection] = {}
        lock = threading.Lock()

        def serve(sock: socket.socket) -> float | None:
            with lock:
                connection = connections.get(sock)
                if connection is None:
                    connection = connections[sock] = Connection(
                        sock,
                        handler,
                        timeouts=chosen,
                        draining=lambda: self.draining,
                        parse=parse,
                        body_budget=self.buffered,
                    )
            wait = None
            try:
                wait = connection.serve()
            finally:
                if wait is None:
                    with lock:
                        connections.pop(sock, None)
            return wait

        def expire(sock: socket.socket) -> None:
            with lock:
                connections.pop(sock, None)

        super().__init__(
            host,
            port,
            serve,
            protocol="HTTP",
            max_connections=max_connections,
            max_open=max_open,
            first_wait_s=chosen.idle_s,
            expire=expire,
            listening=listening,
        )
