"""What the attacks send: raw HTTP/2 frames, gRPC messages and HTTP/1.1 requests built by hand.

A well-behaved client never sends most of these, so no client library is used:
the frames and heads are written byte for byte, to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import struct
import time
import zlib
from dataclasses import dataclass

import hpack
import numpy as np
from tritonclient.grpc import service_pb2 as pb

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 8, 9
END_STREAM, END_HEADERS = 0x1, 0x4
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
LIVE_PATH = "/inference.GRPCInferenceService/ServerLive"
IDENTITY_N = 262144
"""Elements of the attacks' ``identity`` tensor (FP32, 1 MB): large enough to go through a slot."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """One server under attack: where its ports are, and whose memory to watch.

    Attributes:
        name: ``frontdoor`` or ``triton``.
        host: Always ``127.0.0.1``.
        http_port: Its KServe v2 HTTP port.
        grpc_port: Its KServe v2 gRPC port.
        stats_url: Triton's HTTP ``host:port`` (model statistics: the calls the server ran).
    """

    name: str
    host: str
    http_port: int
    grpc_port: int
    stats_url: str

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP port."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC port."""
        return f"{self.host}:{self.grpc_port}"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def settings(**values: int) -> bytes:
    """A SETTINGS frame (``initial_window_size=0``, ``max_frame_size=...``)."""
    ids = {"header_table_size": 1, "max_concurrent_streams": 3, "initial_window_size": 4, "max_frame_size": 5}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items()))


def request_block(path: str, *extra: tuple[str, str]) -> bytes:
    """The header block of a gRPC call of ``path`` (a fresh HPACK encoder's)."""
    return hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "x"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
    )


def grpc_framed(message: bytes, *, compressed: bool = False) -> bytes:
    """``message`` behind gRPC's 5-byte prefix."""
    return bytes([1 if compressed else 0]) + len(message).to_bytes(4, "big") + message


def identity_message(x: np.ndarray, request_id: str = "", version: str = "") -> bytes:
    """A serialised ``ModelInferRequest`` of ``identity`` (of ``version``, if given) with the FP32
    ``[1, n]`` tensor ``x``."""
    request = pb.ModelInferRequest(model_name="identity", id=request_id, model_version=version)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, x.size])
    request.raw_input_contents.append(np.ascontiguousarray(x, np.float32).tobytes())
    return request.SerializeToString()


def add_sub_message() -> bytes:
    """A serialised ``ModelInferRequest`` of ``add_sub`` (two INT32 ``[16]`` inputs)."""
    request = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32")
        tensor.shape.extend([16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return request.SerializeToString()


def http_identity_request(
    x: np.ndarray, *, keep_alive: bool = True, version: str = ""
) -> tuple[bytes, bytes]:
    """(head, body) of a binary KServe v2 ``identity`` request (of ``version``, if given) of the FP32
    ``[1, n]`` tensor ``x``."""
    raw = np.ascontiguousarray(x, np.float32).tobytes()
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[1,%d],"datatype":"FP32","parameters":{"binary_data_size":%d}}],'
        b'"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}' % (x.size, len(raw))
    )
    head = (
        b"POST /v2/models/identity%s/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n%s\r\n"
    ) % (
        b"/versions/" + version.encode() if version else b"",
        len(header),
        len(header) + len(raw),
        b"" if keep_alive else b"Connection: close\r\n",
    )
    return head, header + raw


_BOMBS: dict[int, bytes] = {}


def gzip_bomb(inflated: int) -> bytes:
    """``inflated`` zero bytes, gzip-compressed (made once per size, in 1 MiB pieces)."""
    if inflated not in _BOMBS:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        piece = bytes(1 << 20)
        parts = [packer.compress(piece) for _ in range(inflated >> 20)]
        _BOMBS[inflated] = b"".join(parts) + packer.flush()
    return _BOMBS[inflated]


def connect(host: str, port: int, timeout: float = 10.0, rcvbuf: int | None = None) -> socket.socket:
    """A TCP connection to ``host:port`` (``rcvbuf``: a small receive buffer, set before connecting)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        raise
    return s


def send_quietly(s: socket.socket, data: bytes) -> bool:
    """``sendall`` that reports a connection the server closed (False) rather than raising."""
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


def close_all(sockets: list[socket.socket]) -> None:
    """Close every socket, ignoring errors."""
    for s in sockets:
        with contextlib.suppress(OSError):
            s.close()
    sockets.clear()


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the server has closed (or reset) ``s``: reads what is waiting without blocking."""
    try:
        s.setblocking(False)
        while True:
            got = s.recv(1 << 16)
            if not got:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        with contextlib.suppress(OSError):
            s.setblocking(True)


def raise_fd_limit(needed: int) -> None:
    """Raise this process's open-file limit to ``needed`` (at most the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def server_settings(s: socket.socket, timeout: float = 5.0) -> None:
    """Read the server's first frames up to its SETTINGS (its windows and frame size), and acknowledge
    them; a server that closes or says nothing within ``timeout`` is left as it is."""
    s.settimeout(timeout)
    pending = b""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                return
            pending += got
            while len(pending) >= 9:
                length = int.from_bytes(pending[:3], "big")
                if len(pending) < 9 + length:
                    break
                kind, flags = pending[3], pending[4]
                pending = pending[9 + length :]
                if kind == SETTINGS and not flags & 1:
                    send_quietly(s, frame(SETTINGS, 1, 0))
                    return
    except OSError:
        return


def send_data(s: socket.socket, stream: int, data: bytes, until: float, *, end_stream: bool = True) -> int:
    """Send ``data`` on ``stream`` in 16 KB DATA frames within the server's flow-control windows
    (reading its SETTINGS and WINDOW_UPDATE frames while blocked), until done or the monotonic time
    ``until``; returns the bytes sent."""
    conn_window = stream_window = 65535
    pending = b""
    sent = 0
    while sent < len(data) and time.monotonic() < until:
        room = min(conn_window, stream_window, 16384, len(data) - sent)
        if room > 0:
            piece = data[sent : sent + room]
            last = end_stream and sent + room == len(data)
            if not send_quietly(s, frame(DATA, END_STREAM if last else 0, stream, piece)):
                break
            sent += room
            conn_window -= room
            stream_window -= room
            continue
        s.settimeout(max(0.05, min(1.0, until - time.monotonic())))
        try:
            got = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not got:
            break
        pending += got
        while len(pending) >= 9:
            length = int.from_bytes(pending[:3], "big")
            if len(pending) < 9 + length:
                break
            kind, flags, sid = pending[3], pending[4], int.from_bytes(pending[5:9], "big") & 0x7FFFFFFF
            payload, pending = pending[9 : 9 + length], pending[9 + length :]
            if kind == WINDOW_UPDATE and length == 4:
                increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if sid == 0:
                    conn_window += increment
                elif sid == stream:
                    stream_window += increment
            elif kind == SETTINGS and not flags & 1:
                for i in range(0, length - 5, 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == 4:
                        stream_window += value - 65535
                send_quietly(s, frame(SETTINGS, 1, 0))
            elif kind in (RST_STREAM, 7):  # the stream reset or GOAWAY: nothing more will be read
                return sent
    return sent
