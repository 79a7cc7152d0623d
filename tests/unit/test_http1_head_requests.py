"""The front door's HTTP/1.1 listener answers HEAD with a head alone (RFC 9110 9.3.2, RFC 9112 6.3).

A client reads no content after the answer to a HEAD request, whatever its
``content-length``: content sent anyway would be read as the start of the next
answer on the connection.
"""

from __future__ import annotations

import http.client
import socket

from ray_triton_shm._private.serve.http1.server import HttpListener

_REFUSAL = b'{"error": "Method Not Allowed"}'


def _handler(conn, head, body) -> None:
    """405 with a JSON body for anything but GET (as the front door answers HEAD), else 200 ``live``."""
    body.read_all(1 << 20)
    if head.method == "GET":
        conn.respond(200, [("content-type", "text/plain")], [b"live"])
    else:
        conn.respond(405, [("content-type", "application/json")], [_REFUSAL])


def test_a_head_request_is_answered_without_content_and_the_connection_goes_on() -> None:
    door = HttpListener("127.0.0.1", 0, _handler)
    try:
        client = http.client.HTTPConnection("127.0.0.1", door.port, timeout=10)
        try:
            for method in ("HEAD", "GET", "HEAD", "GET"):  # one kept-alive connection
                client.request(method, "/v2/health/live")
                answer = client.getresponse()
                content = answer.read()
                if method == "HEAD":
                    assert answer.status == 405 and content == b""
                    assert answer.getheader("content-length") == str(len(_REFUSAL))
                else:
                    assert (answer.status, content) == (200, b"live")
        finally:
            client.close()
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as s:
            s.sendall(b"HEAD /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            received = b""
            while chunk := s.recv(65536):
                received += chunk
        assert received.endswith(b"\r\n\r\n") and received.count(b"\r\n\r\n") == 1, received
    finally:
        door.close()
