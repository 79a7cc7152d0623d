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

It reads requests strictly (RFC 9112): every line ends with CRLF; no obsolete
line folding; header names are tokens and values hold no control characters;
``Content-Length`` with ``Transfer-Encoding``, a transfer coding other than one
``chunked``, conflicting ``Content-Length`` values and chunk sizes that are not
plain hex are refused, and the connection closed after the answer (400, or 501
for a transfer coding it does not implement). What it keeps in memory grows
with the bytes that arrive, never with the sizes a client announces; how long
a client may take is bounded by :class:`HttpTimeouts`.

The listening socket has ``SO_REUSEPORT``: every replica of an app on a node
binds the same port and the kernel spreads the connections among them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from ray_triton_shm._private.serve.net.bounded import too_large
from ray_triton_shm._private.serve.net.listener import IDLE_LINGER_S, IOV_BATCH, TcpListener
from ray_triton_shm.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 60.0
"""Time a request's line and headers may take from their first byte (nginx's ``client_header_timeout``)."""
IDLE_TIMEOUT_S = 60.0
"""Time a connection may wait for its next request (nghttpx's ``--frontend-keep-alive-timeout``)."""
BODY_GRACE_S = 20.0
"""Time before :data:`BODY_MIN_RATE` applies, and most silence (Apache's ``RequestReadTimeout body=20``)."""
BODY_MIN_RATE = 500.0
"""Bytes a second a body must average after its grace time (Apache's ``RequestReadTimeout MinRate=500``)."""
SEND_TIMEOUT_S = 60.0
"""Time an answer may take to be written (nginx's ``send_timeout``, here for the whole answer)."""
MAX_HEAD_BYTES = 64 * 1024
"""Longest request line plus headers accepted (Triton's evhtp allows about as much); longer: 431."""
MAX_CHUNK_LINE_BYTES = 1024
"""Longest chunk-size line (size and extensions) of a chunked body."""
MAX_CHUNK_EXTENSION_BYTES = 16 * 1024
"""Chunk extensions a chunked body may carry in all (Node.js's limit)."""
MAX_CHUNK_SIZE_DIGITS = 16
"""Hex digits of a chunk size (16: any 64-bit size); more are refused, not parsed."""
MAX_CONTENT_LENGTH_DIGITS = 18
"""Digits of a ``Content-Length``; more are refused (413) before any arithmetic."""
_RECV_BYTES = 64 * 1024
_GROW_BYTES = 64 * 1024  # a body read whole starts with this much room and doubles as it fills

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"[\x21-\x7e]+")
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


class HttpParseError(InputError):
    """A request this server refuses as HTTP/1.x: it answers ``status`` and closes the connection.

    Args:
        message: What is wrong.
        status: The status to answer (400, 408, 413, 431, 501, 505, ...).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message, status)
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])


class HttpTimeoutError(HttpParseError):
    """A request whose head or body arrived too slowly (see :class:`HttpTimeouts`): 408.

    Args:
        message: What took too long.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, 408)


@dataclass(frozen=True, kw_only=True)
class HttpTimeouts:
    """How long a client may take, per connection (defaults: the module's constants).

    Attributes:
        head_s: A request's line and headers must arrive within this, from their
            first byte: a total deadline, not one per read (else 408 and close).
        idle_s: A kept-alive connection with no request for this long is closed.
        body_grace_s: A body may take this long before ``body_min_rate`` applies;
            it is also the longest a body may go without a byte (else 408 and close).
        body_min_rate: Bytes a second a body must average once ``body_grace_s`` is past.
            Both count only the time the server waits for the client's bytes.
        send_s: An answer not written within this (a client that reads nothing)
            ends its connection.

    Raises:
        ConfigError: A value that is not a finite number > 0.
    """

    head_s: float = HEAD_TIMEOUT_S
    idle_s: float = IDLE_TIMEOUT_S
    body_grace_s: float = BODY_GRACE_S
    body_min_rate: float = BODY_MIN_RATE
    send_s: float = SEND_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("head_s", "idle_s", "body_grace_s", "body_min_rate", "send_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"HttpTimeouts.{name} must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class RequestHead:
    """A parsed request line and headers.

    Attributes:
        method: ``GET``, ``POST``, ... (as sent: methods are case-sensitive).
        path: The path, percent-decoded (as Starlette gives it).
        query: The raw query string (without ``?``).
        version: ``HTTP/1.1`` or ``HTTP/1.0``.
        headers: Header names lower-cased; a repeated header keeps its last value
            (``Transfer-Encoding`` repeated: its codings joined; ``Content-Length``
            repeated with different values is refused).
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
        """Whether the body is chunked (the only transfer coding :func:`parse_head` lets through)."""
        return "transfer-encoding" in self.headers

    @property
    def content_length(self) -> int:
        """The body's length (0 without ``Content-Length``; see :attr:`chunked`)."""
        text = self.headers.get("content-length")
        return 0 if text is None else int(text)


def parse_head(data: bytes | bytearray | memoryview) -> RequestHead:
    """Parse a request line and headers (``data`` ends with the blank line, ``\\r\\n\\r\\n``).

    Raises:
        HttpParseError: Not a valid HTTP/1.x request head (400): a line not
            ended by CRLF, obsolete line folding, a header name that is not a
            token or a value with control characters, two ``Host`` headers,
            ``Content-Length`` with ``Transfer-Encoding``, ``chunked`` not the
            one and final transfer coding, an invalid or conflicting
            ``Content-Length``; a ``Content-Length`` of more than
            :data:`MAX_CONTENT_LENGTH_DIGITS` digits (413); another transfer
            coding before ``chunked`` (501); another HTTP version (505).
    """
    text = bytes(data).decode("latin-1")  # latin-1 decodes any byte
    if not text.endswith("\r\n\r\n"):
        raise HttpParseError("request head does not end with an empty line")
    lines = text[:-4].split("\r\n")
    for line in lines:
        if "\r" in line or "\n" in line:
            raise HttpParseError("bare CR or LF in the request head (lines end with CRLF)")
    method, target, version = _request_line(lines[0])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise HttpParseError("obsolete line folding in the request head")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HttpParseError(f"malformed header line {line[:80]!r}")
        value = value.strip(" \t")
        if not _FIELD_VALUE.fullmatch(value):
            raise HttpParseError(f"control character in header {name[:40]!r}")
        name = name.lower()
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise HttpParseError("conflicting Content-Length headers")
            if name == "host":
                raise HttpParseError("more than one Host header")
            if name == "transfer-encoding":
                value = f"{headers[name]}, {value}"
        headers[name] = value
    length = headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise HttpParseError(f"invalid Content-Length {length[:40]!r}")
        if len(length) > MAX_CONTENT_LENGTH_DIGITS:
            raise HttpParseError(f"Content-Length of {len(length)} digits is too large", 413)
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        _check_transfer_coding(encoding, version, length is not None)
    path, _, query = target.partition("?")
    return RequestHead(method, unquote(path), query, version, headers)


def _request_line(line: str) -> tuple[str, str, str]:
    """(method, target, version) of a request line: single spaces, a token, an origin-form path.

    Raises:
        HttpParseError: Malformed (400), or another HTTP version (505).
    """
    parts = line.split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise HttpParseError(f"malformed request line {line[:80]!r}")
    method, target, version = parts
    if not _VERSION.fullmatch(version):
        raise HttpParseError(f"malformed request line {line[:80]!r}")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpParseError(f"unsupported protocol version {version!r}", 505)
    if not target.startswith("/"):
        raise HttpParseError(f"request target {target[:80]!r} is not a path")
    return method, target, version


def _check_transfer_coding(encoding: str, version: str, has_length: bool) -> None:
    """Refuse any ``Transfer-Encoding`` but one ``chunked`` (RFC 9112 6.1 and 6.3).

    Raises:
        HttpParseError: With ``Content-Length``, in HTTP/1.0, ``chunked`` not the
            final coding or twice (400); another coding before it (501).
    """
    if has_length:
        raise HttpParseError("Content-Length together with Transfer-Encoding")
    if version == "HTTP/1.0":
        raise HttpParseError("Transfer-Encoding in an HTTP/1.0 request")
    codings = [coding.strip(" \t").lower() for coding in encoding.split(",")]
    if not all(codings) or codings[-1] != "chunked":
        raise HttpParseError(f"Transfer-Encoding {encoding[:80]!r} does not end with chunked")
    if codings.count("chunked") > 1:
        raise HttpParseError(f"Transfer-Encoding {encoding[:80]!r} applies chunked more than once")
    if len(codings) > 1:
        raise HttpParseError(f"unsupported Transfer-Encoding {encoding[:80]!r}", 501)


def _chunk_size(line: bytes) -> tuple[int, int]:
    """(size, extension bytes) of a chunk-size line: plain hex digits, then nothing or ``;`` extensions.

    Raises:
        HttpParseError: No digits, more than :data:`MAX_CHUNK_SIZE_DIGITS`, a
            sign, ``0x``, other characters, or control characters in an extension.
    """
    digits = 0
    while digits < len(line) and line[digits] in _HEX_DIGITS:
        digits += 1
    if not digits:
        raise HttpParseError(f"malformed chunk size {line[:40]!r}")
    if digits > MAX_CHUNK_SIZE_DIGITS:
        raise HttpParseError(f"chunk size of more than {MAX_CHUNK_SIZE_DIGITS} hex digits")
    extension = line[digits:]
    if extension:
        text = extension.decode("latin-1")
        if not text.lstrip(" \t").startswith(";") or not _FIELD_VALUE.fullmatch(text):
            raise HttpParseError(f"malformed chunk size {line[:40]!r}")
    return int(line[:digits], 16), len(extension)


def response_head(status: int, headers: Sequence[tuple[str, str]], length: int, keep_alive: bool) -> bytes:
    """The status line and headers of an answer with a body of ``length`` bytes."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append(f"content-length: {length}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class ConnectionGone(Exception):
    """The peer closed the connection, took too long to read an answer, or the server is closing it."""


class _Deadline:
    """A read clock with one fixed deadline (a request head's, an idle connection's).

    Args:
        seconds: From now.
        late: The error when it passes.
    """

    def __init__(self, seconds: float, late: Callable[[], Exception]) -> None:
        self._at = time.monotonic() + seconds
        self.late = late

    def left(self) -> float:
        """Seconds until the deadline."""
        return self._at - time.monotonic()

    def spent(self, seconds: float, n: int) -> None:
        """A read waited ``seconds`` and got ``n`` bytes (nothing changes: the deadline is fixed)."""


class _BodyClock:
    """A body's read clock: ``grace_s`` at first and between bytes, then ``min_rate`` bytes/s on average.

    It counts only the time the server waits for the client (in ``recv``):
    time the server spends on its own between reads (waiting for a slot,
    say) is not the client's.
    """

    def __init__(self, grace_s: float, min_rate: float) -> None:
        self._grace_s = grace_s
        self._min_rate = min_rate
        self._waited = 0.0  # in all
        self._silent = 0.0  # since the last byte
        self._received = 0

    def left(self) -> float:
        """Seconds the next read may wait."""
        rate_left = self._grace_s + self._received / self._min_rate - self._waited
        return min(self._grace_s - self._silent, rate_left)

    def spent(self, seconds: float, n: int) -> None:
        """A read waited ``seconds`` and got ``n`` bytes."""
        self._waited += seconds
        self._silent = 0.0 if n else self._silent + seconds
        self._received += n

    def late(self) -> Exception:
        """The error of a body that came too slowly."""
        return HttpTimeoutError(
            f"request body arrived too slowly (no byte for {self._grace_s:g} s, or under "
            f"{self._min_rate:g} bytes/s after {self._grace_s:g} s)"
        )


class Body:
    """The body of one request, read from what the head's buffer already holds, then the socket.

    What it reads whole grows as bytes arrive (doubling, from 64 KiB): a client
    that announces a large body and sends little gets little memory.

    Args:
        conn: The connection.
        head: The request's head (its length or chunked encoding).
    """

    def __init__(self, conn: Connection, head: RequestHead) -> None:
        self._conn = conn
        self._clock: _BodyClock | None = None
        self._chunked = head.chunked
        self.remaining = 0 if self._chunked else head.content_length
        self._continue = (
            head.headers.get("expect", "").lower() == "100-continue" and head.version == "HTTP/1.1"
        )

    @property
    def chunked(self) -> bool:
        """Whether the body is chunked and not read yet (it can only be read whole then)."""
        return self._chunked

    def _begin(self) -> _BodyClock:
        if self._continue:  # the client waits for this before it sends the body
            self._continue = False
            self._conn.send_parts([b"HTTP/1.1 100 Continue\r\n\r\n"])
        if self._clock is None:
            timeouts = self._conn.timeouts
            self._clock = _BodyClock(timeouts.body_grace_s, timeouts.body_min_rate)
        return self._clock

    def readinto(self, target: memoryview, stall_s: float | None = None) -> int:
        """Fill ``target`` with the next ``len(target)`` bytes of the body.

        Args:
            target: Where the bytes go (a slot's memory, say).
            stall_s: Stop early when a read waits this long for the client
                (``None``: wait as long as the body's clock allows).

        Returns:
            How many bytes were read: ``len(target)``, or fewer when the client
            stalled for ``stall_s`` (the rest is still to read).

        Raises:
            InputError: The body is chunked, or shorter than ``len(target)``.
            HttpTimeoutError: The body came too slowly (see :class:`HttpTimeouts`).
            ConnectionGone: The peer closed the connection.
        """
        if self._chunked:
            raise InputError("a chunked body is read whole")  # callers check Body.chunked first
        if len(target) > self.remaining:
            raise InputError("the request body is shorter than its Content-Length")
        got = self._conn.read_exactly(target, self._begin(), stall_s)
        self.remaining -= got
        return got

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes (at most what is left).

        Raises:
            HttpTimeoutError: The body came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        out = bytearray()
        self._append(out, min(n, self.remaining))
        return bytes(out)

    def read_all(self, max_bytes: int | None = None) -> bytes:
        """The rest of the body (a chunked body de-chunked).

        Args:
            max_bytes: Largest body accepted (``None``: no limit).

        Raises:
            RequestTooLargeError: The body is larger than ``max_bytes``.
            HttpParseError: A malformed chunked body; :class:`HttpTimeoutError`
                when the body came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        out = bytearray()
        self.read_rest_into(out, max_bytes)
        return bytes(out)

    def read_rest_into(self, out: bytearray, max_bytes: int | None = None) -> None:
        """Append the rest of the body (de-chunked) to ``out``, which grows as the bytes arrive.

        Args:
            out: The buffer (it may hold bytes already).
            max_bytes: Largest ``len(out)`` accepted (``None``: no limit).

        Raises:
            As :meth:`read_all`.
        """
        if not self._chunked:
            if max_bytes is not None and len(out) + self.remaining > max_bytes:
                raise too_large("request body", max_bytes)
            self._append(out, self.remaining)
            return
        self._read_chunked(out, max_bytes)

    def _append(self, out: bytearray, n: int) -> None:
        """Read the next ``n`` bytes onto the end of ``out``, growing it no faster than they come."""
        clock = self._begin()
        end = len(out) + n
        while len(out) < end:
            start = len(out)
            out.extend(bytes(min(end - start, max(_GROW_BYTES, start))))
            with memoryview(out) as view:
                got = self._conn.read_exactly(view[start:], clock)
            self.remaining -= got

    def _read_chunked(self, out: bytearray | None, max_bytes: int | None) -> None:
        """Read a chunked body to its end: onto ``out``, or dropped (``None``)."""
        clock = self._begin()
        size_so_far = 0 if out is None else len(out)
        extensions = 0
        scratch = memoryview(bytearray(_RECV_BYTES)) if out is None else None
        while True:
            size, extension = _chunk_size(self._conn.read_line(clock, MAX_CHUNK_LINE_BYTES))
            extensions += extension
            if extensions > MAX_CHUNK_EXTENSION_BYTES:
                raise HttpParseError(f"chunk extensions over {MAX_CHUNK_EXTENSION_BYTES} bytes")
            if size == 0:
                self._read_trailers(clock)
                self._chunked = False
                return
            size_so_far += size
            if max_bytes is not None and size_so_far > max_bytes:
                raise too_large("request body", max_bytes)
            if out is not None:
                self.remaining = size
                self._append(out, size)
            elif scratch is not None:
                while size:
                    step = min(size, len(scratch))
                    size -= self._conn.read_exactly(scratch[:step], clock)
            end = memoryview(bytearray(2))
            self._conn.read_exactly(end, clock)
            if end != b"\r\n":
                raise HttpParseError("a chunk is not followed by CRLF (longer than its size?)")

    def _read_trailers(self, clock: _BodyClock) -> None:
        """Read and drop the trailer fields, up to the blank line (each checked as a header is)."""
        total = 0
        while True:
            line = self._conn.read_line(clock, MAX_HEAD_BYTES)
            if not line:
                return
            total += len(line) + 2
            if total > MAX_HEAD_BYTES:
                raise HttpParseError("trailer fields too large", 431)
            text = line.decode("latin-1")
            name, sep, value = text.partition(":")
            if text[:1] in (" ", "\t") or not sep or not _TOKEN.fullmatch(name):
                raise HttpParseError(f"malformed trailer line {text[:80]!r}")
            if not _FIELD_VALUE.fullmatch(value):
                raise HttpParseError(f"control character in trailer {name[:40]!r}")

    def drain(self, max_bytes: int | None = None) -> None:
        """Read and drop what is left (so that the answer is read by a client still sending).

        Args:
            max_bytes: Most bytes read (``None``: no limit); a larger body is not read.

        Raises:
            RequestTooLargeError: More than ``max_bytes`` are left (close the connection).
            HttpParseError: A malformed chunked body, or one that came too slowly.
            ConnectionGone: The peer closed the connection.
        """
        if self._chunked:
            self._read_chunked(None, max_bytes)
            return
        if max_bytes is not None and self.remaining > max_bytes:
            raise too_large("request body", max_bytes)
        clock = self._begin()
        scratch = memoryview(bytearray(min(self.remaining, _RECV_BYTES)))
        while self.remaining:
            n = min(self.remaining, len(scratch))
            self.remaining -= self._conn.read_exactly(scratch[:n], clock)


Handler = Callable[["Connection", RequestHead, Body], None]


class Connection:
    """One client connection: reads requests one after another and hands each to the handler.

    Args:
        sock: The connected socket.
        handler: Called for each request.
        timeouts: How long the client may take.
    """

    def __init__(
        self, sock: socket.socket, handler: Handler, *, timeouts: HttpTimeouts | None = None
    ) -> None:
        self.sock = sock
        self._handler = handler
        self.timeouts = timeouts or HttpTimeouts()
        self._buf = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes lie in _buf[_start:_end]
        self._end = 0
        self._send_deadline = 0.0
        self.keep_alive = True

    # -- reading ----------------------------------------------------------
    def _recv(self, view: memoryview, clock: _Deadline | _BodyClock, stall_s: float | None = None) -> int:
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

    def _fill(self, clock: _Deadline | _BodyClock) -> None:
        """Read more into the buffer (moving unread bytes to its start first)."""
        if self._start:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        if self._end == len(self._buf):
            raise HttpParseError("request header fields too large", 431)
        self._end += self._recv(self._view[self._end :], clock)

    def read_exactly(
        self, target: memoryview, clock: _Deadline | _BodyClock, stall_s: float | None = None
    ) -> int:
        """Fill ``target``: first from the buffer, then straight from the socket.

        Returns:
            ``len(target)``, or fewer when a read waited ``stall_s`` in vain.

        Raises:
            HttpTimeoutError: ``clock`` ran out.
            ConnectionGone: The peer closed first.
        """
        have = min(self._end - self._start, len(target))
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < len(target):
            got = self._recv(target[have:], clock, stall_s)
            if not got:
                break
            have += got
        return have

    def read_line(self, clock: _Deadline | _BodyClock, limit: int) -> bytes:
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
                self._fill(_Deadline(self.timeouts.idle_s, ConnectionGone))
            except ConnectionGone:
                return None
        head_s = self.timeouts.head_s
        clock = _Deadline(head_s, lambda: HttpTimeoutError(f"request head not received within {head_s:g} s"))
        scanned = 0  # bytes after _start already checked for a bare LF
        while True:
            at = self._buf.find(b"\r\n\r\n", self._start, self._end)
            if at >= 0:
                head = parse_head(self._view[self._start : at + 4])
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
            while sent:
                size = len(views[first])
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0
        return []

    def respond(
        self,
        status: int,
        headers: Sequence[tuple[str, str]],
        parts: Sequence[bytes | memoryview],
        stall_s: float | None = None,
    ) -> bytes:
        """Answer the current request: status, headers and the body ``parts``.

        The whole answer must be written within ``timeouts.send_s``.

        Args:
            status: The status code.
            headers: Headers besides ``content-length`` and ``connection``.
            parts: The body, in parts written as they are.
            stall_s: When the client takes nothing for this long, stop and
                return the rest, copied (``parts`` may be released then).

        Returns:
            ``b""`` when all was written, else the rest of the answer: write it
            with :meth:`send_rest`.

        Raises:
            ConnectionGone: The deadline passed, or the peer is gone.
        """
        self._send_deadline = time.monotonic() + self.timeouts.send_s
        length = sum(memoryview(p).nbytes for p in parts)
        head = response_head(status, headers, length, self.keep_alive)
        rest = self.send_parts([head, *parts], stall_s)
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
                    head = self.read_head()
                    if head is None:
                        return
                    self.keep_alive = head.keep_alive
                    self._handler(self, head, Body(self, head))
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
        clock = _Deadline(limit_s, ConnectionGone)
        dropped = 0
        with contextlib.suppress(OSError, ConnectionGone):
            while dropped < limit_bytes:
                dropped += self._recv(self._view, clock)


def _error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class HttpListener(TcpListener):
    """A listening socket (``SO_REUSEPORT``): each connection served in a thread while it has
    requests, and parked in the listener's selector (no thread) while it is idle between them.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Called for every request, in the connection's thread.
        max_connections: Connections served at once; idle ones wait without a thread.
        timeouts: How long a client may take (heads, bodies, idle waits, answers).

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
    ) -> None:
        chosen = timeouts or HttpTimeouts()
        connections: dict[socket.socket, Connection] = {}
        lock = threading.Lock()

        def serve(sock: socket.socket) -> float | None:
            with lock:
                connection = connections.get(sock)
                if connection is None:
                    connection = connections[sock] = Connection(sock, handler, timeouts=chosen)
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
            first_wait_s=chosen.idle_s,
            expire=expire,
        )
