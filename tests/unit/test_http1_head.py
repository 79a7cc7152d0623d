"""Request heads read by llhttp (``parse_head``) and by hand (``parse_head_by_hand``): the same rules.

The socket-level strictness (status, message, connection closed) is in
``test_frontdoor_http1.py``; here the two readers are compared head by head,
on what llhttp reads alone and on what the checks on top of it catch.
"""

from __future__ import annotations

import pytest

from ray_triton_shm._private.serve.http1.head import HttpParseError, parse_head, parse_head_by_hand

_GOOD = b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nHost: a\r\n"

ACCEPTED = [
    _GOOD + b"Content-Length: 3\r\n\r\n",
    _GOOD + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\n",  # the same length twice (RFC 9110 8.6)
    _GOOD + b"Transfer-Encoding: Chunked\r\n\r\n",
    _GOOD + b"X:  a\tb \xe9 \t\r\nY:\r\nInference-Header-Content-Length: 0\r\n\r\n",
    b"GET /v2/health/ready HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET /a%20b HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",  # no switch is made
    b"GET /a{b}|c HTTP/1.1\r\n\r\n",
]


@pytest.mark.parametrize("head", ACCEPTED)
def test_both_readers_read_a_well_formed_head_alike(head: bytes) -> None:
    assert parse_head(head) == parse_head_by_hand(head)


REFUSED = [
    # what llhttp refuses itself: the hand-written reader names the fault
    (_GOOD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "together"),
    (_GOOD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "conflicting"),
    (_GOOD + b"Content-Length: +5\r\n\r\n", 400, "invalid Content-Length"),
    (_GOOD + b"Content-Length: " + b"9" * 40 + b"\r\n\r\n", 413, "too large"),
    (_GOOD + b"Transfer-Encoding: chunked, gzip\r\n\r\n", 400, "does not end with chunked"),
    (b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 400, "obsolete line folding"),
    (b"GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n", 400, "bare CR or LF"),
    (b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400, "control character"),
    (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "malformed header line"),
    (b"GET / HTTP/1.2\r\n\r\n", 505, "protocol version"),
    # what llhttp lets through: the checks on top refuse it
    (b"GET  / HTTP/1.1\r\n\r\n", 400, "malformed request line"),
    (b"GET ftp://a/b HTTP/1.1\r\n\r\n", 400, "is not a path"),
    (b"GET / HTTP/2.0\r\n\r\n", 505, "protocol version"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "more than one Host"),
    (_GOOD + b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501, "unsupported Transfer-Encoding"),
    (_GOOD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "more than once"),
    (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "HTTP/1.0"),
    (b"CONNECT a:80 HTTP/1.1\r\n\r\n", 400, "is not a path"),
]


@pytest.mark.parametrize(("head", "status", "message"), REFUSED)
def test_both_readers_refuse_a_malformed_head_alike(head: bytes, status: int, message: str) -> None:
    for parse in (parse_head, parse_head_by_hand):
        with pytest.raises(HttpParseError, match=message) as refused:
            parse(head)
        assert refused.value.status == status


@pytest.mark.parametrize("head", [b"FOO / HTTP/1.1\r\n\r\n", b"get / HTTP/1.1\r\n\r\n"])
def test_a_method_llhttp_does_not_know_is_refused(head: bytes) -> None:
    parse_head_by_hand(head)  # a token: the hand-written reader lets the router answer it
    with pytest.raises(HttpParseError, match="malformed request head: Invalid method") as refused:
        parse_head(head)
    assert refused.value.status == 400
