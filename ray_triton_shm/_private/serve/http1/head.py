"""HTTP/1.1 as the front door reads it (RFC 9112, strictly): request heads, chunk-size lines, answers' heads.

Everything here works on bytes already read; :mod:`~ray_triton_shm._private.serve.http1.server`
does the reading. Request heads are read by llhttp (``httptools``, the parser of
Node.js and uvloop) and checked on top for what llhttp lets through (the request
line, a second ``Host``, the transfer codings, the versions served); a head
llhttp refuses is read again by :func:`parse_head_by_hand`, which names the
fault. A request that is not HTTP/1.1 as read here raises :class:`HttpParseError`
with the status to answer. Chunked bodies are read by the listener itself
(their payload goes straight into the handler's buffer): their size lines
are read here (:func:`chunk_size`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import httptools

from ray_triton_shm.errors import InputError

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


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


_TARGET = re.compile(r"[\x21-\x7e]+")


_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
# The scheme and authority of an absolute-form request target (RFC 9112 3.2.2), as a proxy's client sends.
_ABSOLUTE = re.compile(r"(?i:https?)://[^/?#]*")


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

    llhttp (``httptools``) reads the lines; the request line and what the
    headers mean are then checked here as :func:`parse_head_by_hand` checks
    them. A head llhttp refuses is read by :func:`parse_head_by_hand`, which
    names the fault; the one head llhttp refuses that it accepts, a
    ``Content-Length`` repeated with the same value (RFC 9110 8.6), is accepted.

    Raises:
        HttpParseError: As :func:`parse_head_by_hand`, or a head llhttp refuses (400).
    """
    raw = bytes(data)
    fields = _Fields()
    try:
        httptools.HttpRequestParser(fields).feed_data(raw)
    except httptools.HttpParserUpgrade:
        pass  # an Upgrade header (or CONNECT): the head was read whole; no protocol switch is made
    except httptools.HttpParserError as e:
        head = parse_head_by_hand(raw)  # raises, naming the fault, unless it reads the head
        if str(e) != "Duplicate Content-Length":
            raise HttpParseError(f"malformed request head: {e}") from None
        return head
    line = raw[: raw.index(b"\r\n")].decode("latin-1")
    return assemble_head(*read_request_line(line), fields.fields)


class _Fields:
    """The header fields llhttp reads (its callbacks), names and values decoded as latin-1."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields: list[tuple[str, str]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.decode("latin-1"), value.decode("latin-1").strip(" \t")))


def parse_head_by_hand(data: bytes | bytearray | memoryview) -> RequestHead:
    """Parse a request line and headers without llhttp: each line read and checked here.

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
    request_line = read_request_line(lines[0])
    fields: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise HttpParseError("obsolete line folding in the request head")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HttpParseError(f"malformed header line {line[:80]!r}")
        value = value.strip(" \t")
        if not _FIELD_VALUE.fullmatch(value):
            raise HttpParseError(f"control character in header {name[:40]!r}")
        fields.append((name, value))
    return assemble_head(*request_line, fields)


def assemble_head(method: str, target: str, version: str, fields: list[tuple[str, str]]) -> RequestHead:
    """The head of a request line and its header fields (each a token and a value already checked).

    Raises:
        HttpParseError: As :func:`parse_head_by_hand`, for what the fields mean together.
    """
    headers: dict[str, str] = {}
    for name, value in fields:
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


def read_request_line(line: str) -> tuple[str, str, str]:
    """(method, target, version) of a request line: single spaces, a token, an origin-form path
    (the path and query of an absolute-form target).

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
        # RFC 9112 3.2.2: a server accepts the absolute-form; its path (and query) is the target.
        absolute = _ABSOLUTE.match(target)
        if absolute is None:
            raise HttpParseError(f"request target {target[:80]!r} is not a path")
        target = "/" + target[absolute.end() :].removeprefix("/")
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


def chunk_size(line: bytes) -> tuple[int, int]:
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


def check_trailer(line: bytes) -> None:
    """Refuse a chunked body's trailer line (without its CRLF) that is not a well-formed field.

    Raises:
        HttpParseError: Folded, a name that is not a token, or a control character in its value.
    """
    text = line.decode("latin-1")
    name, sep, value = text.partition(":")
    if text[:1] in (" ", "\t") or not sep or not _TOKEN.fullmatch(name):
        raise HttpParseError(f"malformed trailer line {text[:80]!r}")
    if not _FIELD_VALUE.fullmatch(value):
        raise HttpParseError(f"control character in trailer {name[:40]!r}")
