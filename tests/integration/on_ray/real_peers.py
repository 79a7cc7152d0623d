"""Driving real HTTP/2 and HTTP/1.1 peers against a front door, and reading what they report.

Used by ``test_real_peers.py``: the programs (``h2load``, ``nghttp`` from
Debian's ``nghttp2-client``, and ``curl``) run unchanged as subprocesses, each
bounded by a timeout; their output is parsed here. :class:`RawH2` is a strict
HTTP/2 client written frame by frame, for what a well-behaved peer never does
(bad window updates) and for checking the server's flow control byte by byte.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hpack
import numpy as np
import psutil
import pytest
import yaml

from tests.helpers import H2_PREFACE, h2_frame, h2_request_block

from .conftest import config_copy, local_ray

INSTALL_HINT = "`make peers` installs it (Debian packages nghttp2-client and curl)"
PEER_TIMEOUT_S = 120
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"
GRPC_HEADERS = ["-H", "content-type: application/grpc", "-H", "te: trailers"]

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 1, 3
INITIAL_WINDOW_SIZE = 4
MAX_WINDOW = 2**31 - 1


def tool(name: str) -> str:
    """The path of program ``name``; the test skips, saying how to install it, when it is absent."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: {INSTALL_HINT}")
    return path


def run_peer(
    argv: list[str], cwd: Path | None = None, timeout_s: float = PEER_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run a peer program in ``cwd`` to its end (bytes out); fails the test if it runs past ``timeout_s``."""
    try:
        return subprocess.run(argv, cwd=cwd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed and reaped it
        pytest.fail(f"{argv[0]} ran past {timeout_s} s: {argv}\n{(e.stderr or b'')[-2000:]!r}")


def shown(result: subprocess.CompletedProcess) -> str:
    """A run's command, exit code and output tail, for a failure message."""
    out, err = result.stdout[-3000:], result.stderr[-3000:]
    return f"{result.args}\nexit {result.returncode}\n--- stdout ---\n{out!r}\n--- stderr ---\n{err!r}"


# -- the app ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_door(tmp_dir: Path, grpc_engine: str = "python") -> Iterator[dict]:
    """deployments/triton_shm.yaml with one replica, its front door on free ports (gRPC served by
    ``grpc_engine``), on a local Ray.

    Yields:
        ``http`` and ``grpc`` (the front door's ``host:port``), ``triton`` (the node
        Triton's HTTP and gRPC addresses) and ``where`` (the replica's whereami).
    """
    from ray_triton_shm.serve import run_config_file

    path, _ = config_copy(tmp_dir, quarantine_s=1.0)
    spec = yaml.safe_load(path.read_text())
    spec["applications"][0]["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1}]
    path.write_text(yaml.safe_dump(spec))
    ports = spec["applications"][0]["args"]["frontdoor"]
    ports["grpc_engine"] = grpc_engine
    path.write_text(yaml.safe_dump(spec))
    with local_ray():
        where = run_config_file(str(path))["triton"].whereami.remote().result()
        yield {
            "http": f"127.0.0.1:{ports['http_port']}",
            "grpc": f"127.0.0.1:{ports['grpc_port']}",
            "triton": (where["http_url"], where["grpc_url"]),
            "where": where,
        }


def random_rows(sizes: list[int], seed: int) -> list[np.ndarray]:
    """Random FP32 rows ``[1, n]``, one for each size."""
    rng = np.random.default_rng(seed)
    return [rng.random((1, n), dtype=np.float32) for n in sizes]


def busy_slots() -> dict[str, int]:
    """{model: slots in use} of the node's pools (from the node actor)."""
    import ray

    from ray_triton_shm.node import get_node_actor

    pools = ray.get(get_node_actor().status.remote(), timeout=60)["pools"]
    return {model: p["slots"] - p["free"] for model, p in pools.items() if p["slots"] != p["free"]}


def no_slot_held(timeout_s: float = 75.0) -> bool:
    """Whether every slot is free within ``timeout_s``: past the shipped config's quarantine
    (30 s, a slot whose call the client gave up on while Triton may still run it) and a
    connection's idle time (60 s, after which a connection that still has a view of a slot is
    closed), the longest a slot may rightly stay out after a call."""
    deadline = time.monotonic() + timeout_s
    while busy_slots() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not busy_slots()


# -- gRPC messages (requests and framing: the attack suite's, in ``bench.attacks.wire``) ----------


def grpc_unframed(body: bytes) -> bytes:
    """The one message of a unary answer's body; asserts the body is exactly one whole message."""
    assert len(body) >= 5 and body[0] == 0, f"not an uncompressed gRPC message: {body[:16]!r}"
    length = int.from_bytes(body[1:5], "big")
    assert len(body) == 5 + length, f"a body of {len(body)} bytes for a message of {length}"
    return body[5:]


def identity_output(message: bytes) -> np.ndarray:
    """OUTPUT0 of a serialised ``ModelInferResponse`` of identity, as an FP32 array of its shape."""
    from tritonclient.grpc import service_pb2 as pb

    answer = pb.ModelInferResponse.FromString(message)
    assert answer.model_name == "identity" and [o.name for o in answer.outputs] == ["OUTPUT0"], answer
    assert answer.outputs[0].datatype == "FP32"
    shape = list(answer.outputs[0].shape)
    return np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(shape)


def unary_answer(address: str, message: bytes, method: str = MODEL_INFER) -> bytes:
    """The serialised answer of the gRPC server at ``address`` to the serialised request ``message``."""
    import grpc

    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=unlimited) as channel:
        return channel.unary_unary(method)(message, timeout=120)


def connections_to(port: int) -> int:
    """How many TCP connections this process has established to ``port``."""
    me = psutil.Process()
    connections = me.net_connections(kind="tcp") if hasattr(me, "net_connections") else me.connections("tcp")
    return sum(
        1 for c in connections if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


# -- h2load ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class H2loadSummary:
    """What ``h2load`` reports at its end: request outcomes, status classes and DATA bytes received."""

    total: int
    started: int
    done: int
    succeeded: int
    failed: int
    errored: int
    timeout: int
    status: dict[str, int]
    data_bytes: int


def h2load_summary(stdout: str) -> H2loadSummary:
    """Parse h2load's summary lines (``requests:``, ``status codes:``, ``traffic:``)."""
    requests = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        stdout,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", stdout)
    traffic = re.search(r"traffic: .*\((\d+)\) data", stdout)
    assert requests and codes and traffic, f"no summary in h2load's output:\n{stdout[-3000:]}"
    return H2loadSummary(
        *(int(v) for v in requests.groups()),
        status=dict(zip(("2xx", "3xx", "4xx", "5xx"), (int(v) for v in codes.groups()), strict=True)),
        data_bytes=int(traffic.group(1)),
    )


# -- nghttp -v ------------------------------------------------------------------------------------


@dataclass
class PeerStream:
    """One stream's answer as a peer received it: header fields, trailer fields and body."""

    headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)


_NGHTTP_FIELD = re.compile(rb"\[\s*[\d.]+\] recv \(stream_id=(\d+)\) ([^:\s][^:]*|:[a-z]+): ([^\n]*)\n")
_NGHTTP_DATA = re.compile(
    rb"\[\s*[\d.]+\] recv DATA frame <length=(\d+), flags=0x[0-9a-f]+, stream_id=(\d+)>"
)
_NGHTTP_HEADERS = re.compile(
    rb"\[\s*[\d.]+\] recv HEADERS frame <length=\d+, flags=0x([0-9a-f]+), stream_id=(\d+)>"
)


def nghttp_streams(stdout: bytes) -> dict[int, PeerStream]:
    """Each stream's answer from ``nghttp -v``'s output.

    nghttp writes a DATA frame's bytes to stdout just before the line that logs the
    frame (``recv DATA frame <length=L, ...>``), so the L bytes before that line
    are the frame's data; header fields are logged one a line before the HEADERS
    frame that carried them (the second block of a stream is its trailers).
    """
    streams: dict[int, PeerStream] = {}
    pending: dict[int, dict[str, str]] = {}
    events = sorted(
        [(m.start(), "field", m) for m in _NGHTTP_FIELD.finditer(stdout)]
        + [(m.start(), "data", m) for m in _NGHTTP_DATA.finditer(stdout)]
        + [(m.start(), "headers", m) for m in _NGHTTP_HEADERS.finditer(stdout)],
        key=lambda event: event[0],
    )
    for start, kind, match in events:
        if kind == "field":
            name, value = match.group(2).decode(), match.group(3).decode().rstrip("\r")
            pending.setdefault(int(match.group(1)), {})[name] = value
        elif kind == "data":
            length, stream_id = int(match.group(1)), int(match.group(2))
            streams.setdefault(stream_id, PeerStream()).body += stdout[start - length : start]
        else:
            stream_id = int(match.group(2))
            stream = streams.setdefault(stream_id, PeerStream())
            fields = pending.pop(stream_id, {})
            if not stream.headers:
                stream.headers = fields
            else:
                stream.trailers = fields
    return streams


# -- curl -D --------------------------------------------------------------------------------------


def curl_answer(dump: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(status lines, the last head's fields, trailer fields) from curl's ``-D`` dump.

    The dump holds each response head (a status line and its fields, then an
    empty line); over HTTP/2 the trailers follow the last head as a block of
    fields without a status line.
    """
    statuses: list[str] = []
    headers: dict[str, str] = {}
    trailers: dict[str, str] = {}
    for block in dump.split("\r\n\r\n"):
        lines = [line for line in block.split("\r\n") if line]
        if not lines:
            continue
        fields = {}
        for line in lines:
            if not line.startswith("HTTP/"):
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
        if lines[0].startswith("HTTP/"):
            statuses.append(lines[0].strip())
            headers, trailers = fields, {}
        else:
            trailers.update(fields)
    return statuses, headers, trailers


# -- a strict HTTP/2 client, frame by frame -------------------------------------------------------


Frame = tuple[int, int, int, bytes]
"""A frame as :class:`RawH2` reads it: type, flags, stream, payload."""


def stream_frames(frames: list[Frame], stream: int, kind: int) -> list[tuple[int, bytes]]:
    """(flags, payload) of the frames of type ``kind`` on ``stream``."""
    return [(flags, payload) for k, flags, s, payload in frames if s == stream and k == kind]


def ended(frames: list[Frame], streams) -> bool:
    """Whether each of ``streams`` has had its last header block (trailers, END_STREAM)."""
    return all(any(flags & END_STREAM for flags, _ in stream_frames(frames, s, HEADERS)) for s in streams)


def reset_code(frames: list[Frame], stream: int) -> int | None:
    """The error code of the RST_STREAM on ``stream``, if one came."""
    codes = [int.from_bytes(p, "big") for _, p in stream_frames(frames, stream, RST_STREAM)]
    return codes[0] if codes else None


class RawH2:
    """One HTTP/2 connection to a gRPC server, every frame sent and read by hand.

    Args:
        address: ``host:port``.
        initial_window: Our SETTINGS_INITIAL_WINDOW_SIZE (``None``: the default, 65535).
        timeout_s: How long each read may wait.
    """

    def __init__(self, address: str, initial_window: int | None = None, timeout_s: float = 30.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._buffer = b""
        self._decoder = hpack.Decoder()
        self.server_settings: dict[int, int] = {}
        self.server_window = 65535  # the connection window the server gives us (for our requests)
        settings = (
            b""
            if initial_window is None
            else INITIAL_WINDOW_SIZE.to_bytes(2, "big") + initial_window.to_bytes(4, "big")
        )
        self.sock.sendall(H2_PREFACE + h2_frame(len(settings), SETTINGS, 0, 0) + settings)
        # The server's SETTINGS and its ACK of ours (with any WINDOW_UPDATE it sent meanwhile)
        # before any request: the server's windows are known.
        acked = False
        while not (self.server_settings and acked):
            kind, flags, stream, payload = self.frame()
            self.handle_control(kind, flags, stream, payload)
            acked = acked or (kind == SETTINGS and bool(flags & ACK))
        # A PING's round trip: a WINDOW_UPDATE the server sent after its ACK is known too.
        self.sock.sendall(h2_frame(8, PING, 0, 0) + b"windows?")
        while True:
            kind, flags, stream, payload = self.frame()
            self.handle_control(kind, flags, stream, payload)
            if kind == PING and flags & ACK:
                break

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def frame(self) -> Frame:
        """The next frame (type, flags, stream, payload); ``EOFError`` when the server closed."""
        while True:
            if len(self._buffer) >= 9:
                length = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) >= 9 + length:
                    head, self._buffer = self._buffer[:9], self._buffer[9:]
                    payload, self._buffer = self._buffer[:length], self._buffer[length:]
                    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload
            try:
                got = self.sock.recv(1 << 20)
            except ConnectionResetError:
                got = b""
            if not got:
                raise EOFError("the server closed the connection")
            self._buffer += got

    def handle_control(self, kind: int, flags: int, stream: int, payload: bytes) -> bool:
        """Answer a SETTINGS or PING as a client must; note the server's window. Whether it was one."""
        if kind == SETTINGS:
            if not flags & ACK:
                for offset in range(0, len(payload), 6):
                    key = int.from_bytes(payload[offset : offset + 2], "big")
                    self.server_settings[key] = int.from_bytes(payload[offset + 2 : offset + 6], "big")
                self.sock.sendall(h2_frame(0, SETTINGS, ACK, 0))
            return True
        if kind == PING:
            if not flags & ACK:
                self.sock.sendall(h2_frame(8, PING, ACK, 0) + payload)
            return True
        if kind == WINDOW_UPDATE:
            if not stream:
                self.server_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
            return True
        return False

    def decode(self, block: bytes) -> dict[str, str]:
        """A header block's fields (the connection's HPACK state advances)."""
        return dict(self._decoder.decode(block))

    def request(self, stream: int, path: str, body: bytes = b"", end: bool = True) -> None:
        """HEADERS of a gRPC call of ``path`` on ``stream``, then ``body`` (if any) in DATA frames."""
        block = h2_request_block(path)
        flags = END_HEADERS | (END_STREAM if end and not body else 0)
        self.sock.sendall(h2_frame(len(block), HEADERS, flags, stream) + block)
        if body:
            self.data(stream, body, end=end)

    def data(self, stream: int, body: bytes, end: bool = True) -> None:
        """``body`` on ``stream`` in DATA frames of at most 16384 bytes (the server's windows are 2 GB)."""
        frames = []
        for offset in range(0, len(body), 16384):
            chunk = body[offset : offset + 16384]
            last = end and offset + 16384 >= len(body)
            frames.append(h2_frame(len(chunk), DATA, END_STREAM if last else 0, stream) + chunk)
        self.server_window -= len(body)
        assert self.server_window >= 0, "the client would overrun the server's connection window"
        self.sock.sendall(b"".join(frames))

    def window_update(self, stream: int, increment: int) -> None:
        self.sock.sendall(h2_frame(4, WINDOW_UPDATE, 0, stream) + increment.to_bytes(4, "big"))

    def settings(self, key: int, value: int) -> None:
        payload = key.to_bytes(2, "big") + value.to_bytes(4, "big")
        self.sock.sendall(h2_frame(6, SETTINGS, 0, 0) + payload)

    def confirmed_quiet(self) -> list[Frame]:
        """A PING, and the frames up to its ACK (the server has read everything sent before it)."""
        self.sock.sendall(h2_frame(8, PING, 0, 0) + b"quiet?!!")
        return self.until(lambda frames: bool(frames) and frames[-1][0] == PING and frames[-1][1] & ACK)

    def goaway(self) -> tuple[int, int, bytes]:
        """The server's GOAWAY (last stream, code, debug data), read up to the connection's close."""
        frames: list[Frame] = []
        with contextlib.suppress(EOFError, OSError):
            while True:
                frames.append(self.frame())
        (payload,) = [p for kind, _, _, p in frames if kind == GOAWAY]
        return int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big"), payload[8:]

    def until(self, done, on_data=None) -> list[Frame]:
        """Read frames (control frames answered) until ``done(frames so far)``; returns them all.

        ``on_data(stream, payload)`` is called for each DATA frame as it arrives; without it,
        each DATA frame's bytes are given back to both windows at once (as most clients do).
        """
        frames: list[Frame] = []
        while not done(frames):
            kind, flags, stream, payload = self.frame()
            self.handle_control(kind, flags, stream, payload)
            if kind == DATA and on_data is not None:
                on_data(stream, payload)
            elif kind == DATA and payload:
                self.sock.sendall(
                    b"".join(
                        h2_frame(4, WINDOW_UPDATE, 0, s) + len(payload).to_bytes(4, "big")
                        for s in (0, stream)
                    )
                )
            frames.append((kind, flags, stream, payload))
        return frames
