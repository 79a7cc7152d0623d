"""What real HTTP/1.1 clients send, answered by the front door's listener as RFC 9110 and 9112 say.

* ``HEAD``: the answer is its head alone (RFC 9110 9.3.2, RFC 9112 6.3). A client
  reads no content after it, whatever its ``content-length``: content sent anyway
  would be read as the start of the next answer on the connection.
* An absolute-form request target (``GET http://host/path``, what a client sends
  to a proxy) is accepted, its path and query the request's (RFC 9112 3.2.2).
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import pytest

from ray_triton_shm._private.serve.http1.server import HttpListener

_REFUSAL = b'{"error": "Method Not Allowed"}'


def _handler(conn, head, body) -> None:
    """405 with a JSON body for anything but GET (as the front door answers HEAD); GET: its path and query."""
    body.read_all(1 << 20)
    if head.method == "GET":
        conn.respond(200, [("content-type", "text/plain")], [f"{head.path}?{head.query}".encode()])
    else:
        conn.respond(405, [("content-type", "application/json")], [_REFUSAL])


@pytest.fixture
def port() -> Iterator[int]:
    door = HttpListener("127.0.0.1", 0, _handler)
    try:
        yield door.port
    finally:
        door.close()


def test_a_head_request_is_answered_without_content_and_the_connection_goes_on(port: int) -> None:
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for method in ("HEAD", "GET", "HEAD", "GET"):  # one kept-alive connection
            client.request(method, "/v2/health/live")
            answer = client.getresponse()
            content = answer.read()
            if method == "HEAD":
                assert answer.status == 405 and content == b""
                assert answer.getheader("content-length") == str(len(_REFUSAL))
            else:
                assert (answer.status, content) == (200, b"/v2/health/live?")
    finally:
        client.close()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HEAD /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    assert received.endswith(b"\r\n\r\n") and received.count(b"\r\n\r\n") == 1, received


@pytest.mark.parametrize(
    ("target", "seen"),
    [
        ("http://example.invalid/v2/health/live", "/v2/health/live?"),
        ("HTTP://example.invalid:8100/v2/models/a%20b/ready?x=1", "/v2/models/a b/ready?x=1"),
        ("http://example.invalid", "/?"),
        ("http://example.invalid?x=1", "/?x=1"),
    ],
)
def test_an_absolute_form_target_is_the_path_and_query_it_names(port: int, target: str, seen: str) -> None:
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        client.request("GET", target)  # as sent to a proxy: the request line holds the whole URI
        answer = client.getresponse()
        assert (answer.status, answer.read().decode()) == (200, seen)
    finally:
        client.close()
