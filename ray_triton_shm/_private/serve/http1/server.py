"""A lean HTTP/1.1 server for KServe v2: blocking sockets, a thread per connection, bodies read in place.

The front door's HTTP half (see :mod:`ray_triton_shm._private.serve.door.frontdoor`). It
speaks just what KServe v2 clients send: a request line and headers, a body of
``Content-Length`` bytes (or chunked), keep-alive connections (HTTP/1.1 by
default, HTTP/1.0 on ``Connection: keep-alive``), ``Expect: 100-continue``.
A handler gets the parsed head and a :class:`Body` it reads from: into any
buffer it likes (``readinto``, straight from the socket into a shared-memory
slot), or whole (``read_all``). It answers with :meth:`Connection.respond`,
whose body parts (views of a slot, say) go to the socket as they are
(``sendmsg``), without being joined first.

The listening socket has ``SO_REUSEPORT``: every replica of an app on a node
binds the same port and the kernel spreads the connections among them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from ray_triton_shm._private.serve.net.bounded import too_large
from ray_triton_shm._private.serve.net.listener import TcpListener, send_parts
from ray_triton_shm.errors import InputError

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0
"""How long a kept-alive connection may wait for its next request before the server closes it."""
BODY_TIMEOUT_S = 30.0
"""How long a request's body may go without a byte before the server gives up on it (and its slot)."""
MAX_HEAD_BYTES = 64 * 1024
"""Longest request line plus headers accepted (Triton's evhtp allows about as much); longer: 431."""
_RECV_BYTES = 64 * 1024

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class HttpParseError(InputError):
    """A request that is not HTTP/1.x as this server reads it.

    Args:
        message: What is wrong.
        status: The status to answer (400, 411, 431, 501, ...).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message, status)
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class RequestHead:
    """A parsed request line and headers.

    Attributes:
        method: ``GET``, ``POST``, ...
        path: The path, percent-decoded (as Starlette gives it).
        query: The raw query string (without ``?``).
        version: ``HTTP/1.1`` or ``HTTP/1.0``.
        headers: Header names lower-cased; a repeated header keeps its last value
            (``Content-Length`` repeated with different values is refused).
    """

    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]

    @property
    def keep_alive(self) -> bool:
        """Whether the connection stays open after the answer (HTTP/1.1 unless ``close``)."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens

    @property
    def chunked(self) -> bool:
        return "transfer-encoding" in self.headers

    @property
    def content_length(self) -> int:
        """The body's length (0 without ``Content-Length``; see :attr:`chunked`)."""
        text = self.headers.get("content-length")
        return 0 if text is None else int(text)


def parse_head(data: bytes | bytearray | memoryview) -> RequestHead:
    """Parse a request line and headers (``data`` ends with the blank line, ``\\r\\n\\r\\n``).

    Raises:
        HttpParseError: Not a valid HTTP/1.x request head, an unsupported
            transfer encoding (501), an invalid or conflicting ``Content-Length``.
    """
    try:
        text = bytes(data).decode("latin-1")
    except UnicodeDecodeError as e:  # latin-1 decodes any byte; kept for clarity
        raise HttpParseError("request head is not text") from e
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise HttpParseError(f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpParseError(f"unsupported protocol version {version[:16]!r}", 505)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise HttpParseError(f"malformed header line {line[:80]!r}")
        name = name.lower()
        value = value.strip()
        if name == "content-length" and name in headers and headers[name] != value:
            raise HttpParseError("conflicting Content-Length headers")
        headers[name] = value
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        if encoding.strip().lower() != "chunked":
            raise HttpParseError(f"unsupported Transfer-Encoding {encoding!r}", 501)
        headers.pop("content-length", None)  # chunked wins (RFC 9112 6.3)
    length = headers.get("content-length")
    if length is not None and not (length.isascii() and length.isdigit()):
        raise HttpParseError(f"invalid Content-Length {length!r}")
    path, _, query = target.partition("?")
    if not path.startswith("/"):
        raise HttpParseError(f"request target {target[:80]!r} is not a path")
    return RequestHead(method.upper(), unquote(path), query, version, headers)


def response_head(status: int, headers: Sequence[tuple[str, str]], length: int, keep_alive: bool) -> bytes:
    """The status line and headers of an answer with a body of ``length`` bytes."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append(f"content-length: {length}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class ConnectionGone(Exception):
    """The peer closed the connection (or the server is closing it): stop serving it."""


class Body:
    """The body of one request, read from what the head's buffer already holds, then the socket.

    Args:
        conn: The connection.
        head: The request's head (its length or chunked encoding).
    """

    def __init__(self, conn: Connection, head: RequestHead) -> None:
        self._conn = conn
        conn.sock.settimeout(conn.body_timeout_s)
        self._chunked = head.chunked
        self.remaining = 0 if self._chunked else head.content_length
        self._continue = (
            head.headers.get("expect", "").lower() == "100-continue" and head.version == "HTTP/1.1"
        )

    @property
    def chunked(self) -> bool:
        """Whether the body is chunked and not read yet (it can only be read whole then)."""
        return self._chunked

    def _expect(self) -> None:
        if self._continue:  # the client waits for this before it sends the body
            self._continue = False
            self._conn.send_parts([b"HTTP/1.1 100 Continue\r\n\r\n"])

    def readinto(self, target: memoryview) -> None:
        """Fill ``target`` with the next ``len(target)`` bytes of the body.

        Raises:
            InputError: The body is shorter than that.
            ConnectionGone: The peer closed the connection.
        """
        if self._chunked:
            raise InputError("a chunked body is read whole")  # callers check Body.chunked first
        if len(target) > self.remaining:
            raise InputError("the request body is shorter than its Content-Length")
        self._expect()
        self._conn.read_exactly(target)
        self.remaining -= len(target)

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes (at most what is left)."""
        out = bytearray(min(n, self.remaining))
        self.readinto(memoryview(out))
        return bytes(out)

    def read_all(self, max_bytes: int | None = None) -> bytes:
        """The rest of the body (a chunked body de-chunked).

        Args:
            max_bytes: Largest body accepted (``None``: no limit).

        Raises:
            RequestTooLargeError: The body is larger than ``max_bytes``.
        """
        if not self._chunked:
            if max_bytes is not None and self.remaining > max_bytes:
                raise too_large("request body", max_bytes)
            return self.read(self.remaining)
        self._expect()
        parts = []
        size_so_far = 0
        while True:
            size_line = self._conn.read_line()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError as e:
                raise HttpParseError("malformed chunk size") from e
            if size == 0:
                while self._conn.read_line():  # trailers, up to the blank line
                    pass
                self._chunked = False
                return b"".join(parts)
            size_so_far += size
            if max_bytes is not None and size_so_far > max_bytes:
                raise too_large("request body", max_bytes)
            chunk = bytearray(size)
            self._conn.read_exactly(memoryview(chunk))
            parts.append(bytes(chunk))
            if self._conn.read_line():
                raise HttpParseError("a chunk is longer than its size")

    def drain(self) -> None:
        """Read and drop what is left (so that the answer is read by a client still sending)."""
        if self._chunked:
            self.read_all()
            return
        scratch = memoryview(bytearray(min(self.remaining, 1 << 20)))
        while self.remaining:
            n = min(self.remaining, len(scratch))
            self.readinto(scratch[:n])


Handler = Callable[["Connection", RequestHead, Body], None]


class Connection:
    """One client connection: reads requests one after another and hands each to the handler."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.sock = sock
        self._handler = handler
        self.idle_timeout_s = idle_timeout_s
        self.body_timeout_s = body_timeout_s
        self._buf = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes lie in _buf[_start:_end]
        self._end = 0
        self.keep_alive = True

    # -- reading ----------------------------------------------------------
    def _fill(self) -> None:
        """Read more into the buffer (moving unread bytes to its start first)."""
        if self._start:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        if self._end == len(self._buf):
            raise HttpParseError("request header fields too large", 431)
        try:
            got = self.sock.recv_into(self._view[self._end :])
        except TimeoutError as e:
            raise ConnectionGone() from e
        if not got:
            raise ConnectionGone()
        self._end += got

    def read_exactly(self, target: memoryview) -> None:
        """Fill ``target``: first from the buffer, then straight from the socket.

        Raises:
            ConnectionGone: The peer closed first.
        """
        have = min(self._end - self._start, len(target))
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < len(target):
            try:
                got = self.sock.recv_into(target[have:])
            except TimeoutError as e:  # a stalled client: drop it (and whatever slot it holds)
                raise ConnectionGone() from e
            if not got:
                raise ConnectionGone()
            have += got

    def read_line(self) -> bytes:
        """The next line, without its CRLF (chunked bodies)."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            self._fill()

    def read_head(self) -> RequestHead | None:
        """The next request's head; ``None`` when the peer closed between requests.

        Raises:
            HttpParseError: Not a valid request head.
        """
        self.sock.settimeout(self.idle_timeout_s)
        while True:
            at = self._buf.find(b"\r\n\r\n", self._start, self._end)
            if at >= 0:
                head = parse_head(self._view[self._start : at + 4])
                self._start = at + 4
                return head
            if self._end - self._start >= MAX_HEAD_BYTES:
                raise HttpParseError("request header fields too large", 431)
            try:
                self._fill()
            except ConnectionGone:
                if self._end == self._start:
                    return None
                raise

    # -- writing ----------------------------------------------------------
    def send_parts(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write every part, in order, without joining them (``sendmsg``)."""
        send_parts(self.sock, parts)

    def respond(
        self,
        status: int,
        headers: Sequence[tuple[str, str]],
        parts: Sequence[bytes | memoryview],
    ) -> None:
        """Answer the current request: status, headers and the body ``parts``."""
        length = sum(memoryview(p).nbytes for p in parts)
        self.send_parts([response_head(status, headers, length, self.keep_alive), *parts])

    # -- serving ----------------------------------------------------------
    def serve(self) -> None:
        """Serve requests until the peer closes, a request is unreadable, or the socket is shut."""
        try:
            while self.keep_alive:
                try:
                    head = self.read_head()
                except HttpParseError as e:
                    self.keep_alive = False
                    self.respond(e.status, [("content-type", "application/json")], [_error_json(str(e))])
                    self._linger()
                    return
                if head is None:
                    return
                self.keep_alive = head.keep_alive
                body = Body(self, head)
                self._handler(self, head, body)
            self._linger()
        except (ConnectionGone, OSError):
            return
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()

    def _linger(self, limit_s: float = 1.0, limit_bytes: int = 1 << 20) -> None:
        """Close gently after an answer the client may not have finished sending for.

        The write side is shut first and what the client still sends is read and
        dropped (briefly): closing with unread data would reset the connection
        and could lose the answer before the client reads it.
        """
        self.sock.shutdown(socket.SHUT_WR)
        self.sock.settimeout(limit_s)
        dropped = 0
        with contextlib.suppress(OSError):
            while dropped < limit_bytes:
                got = self.sock.recv_into(self._view)
                if not got:
                    break
                dropped += got


def _error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class HttpListener(TcpListener):
    """A listening socket (``SO_REUSEPORT``) and a thread per connection, each running ``handler``.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Called for every request, in the connection's thread.
        max_connections: Connections served at once; more wait in the backlog.
        idle_timeout_s: A kept-alive connection with no request for this long is closed.
        body_timeout_s: A request body that stalls this long ends its connection.

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
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        timeouts = {"idle_timeout_s": idle_timeout_s, "body_timeout_s": body_timeout_s}

        def serve(sock: socket.socket) -> None:
            Connection(sock, handler, **timeouts).serve()

        super().__init__(host, port, serve, protocol="HTTP", max_connections=max_connections)
