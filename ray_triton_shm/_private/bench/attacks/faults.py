"""HTTP/1.1 requests a strict server refuses (RFC 9112): each sent once, its answer read.

Each carries a valid small ``identity`` request, so a server that accepts the
fault answers 200; one that refuses it answers 4xx or closes the connection.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.bench.attacks.catalog import Attack, hold
from ray_triton_shm._private.bench.attacks.wire import Target

BODY = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
LINE = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
ANSWER_WAIT_S = 5.0


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


FAULTS: dict[str, bytes] = {
    "http-cl-and-te": LINE
    + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(_chunked(BODY))
    + _chunked(BODY),
    "http-chunk-size-negative": LINE + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n" + BODY + b"\r\n0\r\n\r\n",
    "http-chunk-size-overlong": LINE
    + b"Transfer-Encoding: chunked\r\n\r\n"
    + b"0" * 40
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
    "http-bare-lf": LINE.replace(b"Host: x\r\n", b"Host: x\nX-Hidden: 1\r\n")
    + b"Content-Length: %d\r\n\r\n" % len(BODY)
    + BODY,
    "http-obs-fold": LINE + b"X-Folded: a\r\n b\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "http-duplicate-content-length": LINE
    + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(BODY), len(BODY) + 8)
    + BODY
    + b"\x20" * 8,
    "http-space-before-colon": LINE + b"Content-Length : %d\r\n\r\n" % len(BODY) + BODY,
}
"""Each fault's bytes. A chunk size of 40 leading zeros is overlong (servers cap the digits they read)."""

SUMMARIES = {
    "http-cl-and-te": "Content-Length and Transfer-Encoding: chunked together",
    "http-chunk-size-negative": "a chunk size of -1",
    "http-chunk-size-overlong": "a chunk size of 42 hex digits",
    "http-bare-lf": "a header line ended by a bare LF",
    "http-obs-fold": "a header folded onto the next line (obs-fold)",
    "http-duplicate-content-length": "two different Content-Length headers",
    "http-space-before-colon": "white space between a header name and its colon",
}


def send_fault(target: Target, data: bytes) -> str:
    """Send ``data`` once on a fresh connection: the answer's status code, ``closed``, or ``no answer``."""
    with wire.connect(target.host, target.http_port, timeout=ANSWER_WAIT_S) as s:
        if not wire.send_quietly(s, data):
            return "closed"
        with_shut = True
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            with_shut = False
        got = b""
        deadline = time.monotonic() + ANSWER_WAIT_S
        try:
            while b"\r\n" not in got and time.monotonic() < deadline:
                piece = s.recv(4096)
                if not piece:
                    break
                got += piece
        except TimeoutError:
            return "no answer"
        except OSError:
            return "closed" if not got else got.split(b" ", 2)[1].decode(errors="replace")
    if not got:
        return "closed" if with_shut else "no answer"
    parts = got.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 else "garbled"


def refused(answer: str) -> bool:
    """Whether ``answer`` (of :func:`send_fault`) refuses the request: a 4xx or 5xx, or no answer at all."""
    return answer == "closed" or (answer.isdigit() and int(answer) >= 400)


def _fault(name: str):
    def run(target: Target, until: float, scale: float) -> dict[str, Any]:
        answer = send_fault(target, FAULTS[name])
        hold(until)
        return {"answer": answer, "refused": refused(answer)}

    run.__name__ = name.replace("-", "_")
    run.__doc__ = f"Send one request with {SUMMARIES[name]}; its answer."
    return run


ATTACKS = tuple(
    Attack(name=name, kind="protocol", protocol="http", run=_fault(name), summary=SUMMARIES[name])
    for name in FAULTS
)
