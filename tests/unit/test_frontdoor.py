"""The front door's pieces without Ray or Triton: its config, the HTTP parser and listener, the gRPC codec."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.node.port_claim import PortClaim, app_digest, port_claims
from ray_triton_shm._private.serve.door.frontdoor import FrontDoor
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.door.frontdoor_http import KServeHttpHandler
from ray_triton_shm._private.serve.http1.head import HttpParseError, parse_head, response_head
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.http1.timing import HttpTimeouts
from ray_triton_shm._private.serve.protocol.grpc_infer_codec import (
    encode_infer_response_parts,
    encode_varint,
    plan_inputs,
    raw_start,
    split_infer_request,
)
from ray_triton_shm.errors import ConfigError, FrontDoorError, InputError

# -- config ---------------------------------------------------------------


def test_config_defaults_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "HTTP_PORT", "GRPC_PORT", "MAX_CONNECTIONS", "GRPC_THREADS"):
        monkeypatch.delenv(f"RAY_TRITON_SHM_FRONTDOOR_{name}", raising=False)
    config = FrontDoorConfig(http_port=8100)
    assert (config.host, config.http_port, config.grpc_port) == ("127.0.0.1", 8100, None)
    assert FrontDoorConfig.from_args(None) is None
    assert FrontDoorConfig.from_args({"grpc_port": 0}).grpc_port == 0
    with pytest.raises(ConfigError, match="http_port, grpc_port or both"):
        FrontDoorConfig()
    with pytest.raises(ConfigError, match="port"):
        FrontDoorConfig(http_port=70000)
    with pytest.raises(ConfigError, match="port"):
        FrontDoorConfig(http_port=True)
    with pytest.raises(ConfigError, match="both 8100"):
        FrontDoorConfig(http_port=8100, grpc_port=8100)
    with pytest.raises(ConfigError, match="unknown keys \\['port'\\]"):
        FrontDoorConfig.from_args({"port": 8100})
    with pytest.raises(ConfigError, match="mapping"):
        FrontDoorConfig.from_args(8100)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="host"):
        FrontDoorConfig(host="", http_port=1)
    with pytest.raises(ConfigError, match="max_connections"):
        FrontDoorConfig(http_port=1, max_connections=0)
    assert FrontDoorConfig(http_port=1, port_linger_s=0).port_linger_s == 0
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="port_linger_s must be a number >= 0"):
            FrontDoorConfig(http_port=1, port_linger_s=bad)


def test_config_environment_then_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_HOST", "0.0.0.0")
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_GRPC_PORT", "8101")
    config = FrontDoorConfig(http_port=8100)
    assert (config.host, config.grpc_port) == ("0.0.0.0", 8101)
    assert FrontDoorConfig(host="127.0.0.1", http_port=8100, grpc_port=None).grpc_port is None
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_GRPC_PORT", "many")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_FRONTDOOR_GRPC_PORT"):
        FrontDoorConfig(http_port=8100)


def test_every_grpc_limit_is_a_setting_and_reaches_the_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each field of the gRPC listener's limits but the message size (the node's
    ``max_request_bytes``) comes from the ``grpc_``-named setting (the busy stall time from the
    setting both protocols share), explicit or from the environment."""
    import dataclasses

    from ray_triton_shm._private.serve.http2.h2_wire import H2Limits

    # The busy stall time is one setting for both protocols.
    names = {"max_header_block": "grpc_max_header_bytes", "slot_busy_stall_s": "slot_busy_stall_s"}
    values = {
        "slot_busy_stall_s": 0.05,
        "grpc_max_header_bytes": 4096,
        "grpc_idle_timeout_s": 7.5,
        "grpc_preface_timeout_s": 3.0,
        "grpc_glitch_burst": 11,
        "grpc_glitch_rate": 2.5,
        "grpc_slot_stall_s": 0.25,
        "grpc_max_connection_bytes": 1 << 20,
        "grpc_max_buffered_bytes": 1 << 22,
        "grpc_max_streams": 3,
        "grpc_send_timeout_s": 9.0,
        "grpc_max_unsent_bytes": 1 << 21,
        "grpc_max_spare_bytes": 1 << 23,
    }
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_GRPC_MAX_STREAMS", "3")
    explicit = {k: v for k, v in values.items() if k != "grpc_max_streams"}
    limits = FrontDoorConfig(grpc_port=0, **explicit).h2_limits(12345)
    for field in dataclasses.fields(H2Limits):
        if field.name == "max_message":
            assert limits.max_message == 12345
        else:
            setting = names.get(field.name, f"grpc_{field.name}")
            assert getattr(limits, field.name) == values[setting], field.name
    monkeypatch.delenv("RAY_TRITON_SHM_FRONTDOOR_GRPC_MAX_STREAMS")
    assert FrontDoorConfig(grpc_port=0).h2_limits(1) == H2Limits(max_message=1)  # the defaults agree
    for name in (*values, "max_open_connections"):
        if name == "grpc_max_spare_bytes":  # 0 keeps no spare buffers
            assert FrontDoorConfig(grpc_port=0, **{name: 0}).h2_limits(1).max_spare_bytes == 0
            for bad in (-1, True, 1.5):
                with pytest.raises(ConfigError, match=name):
                    FrontDoorConfig(grpc_port=0, **{name: bad})
            continue
        with pytest.raises(ConfigError, match=name):
            FrontDoorConfig(grpc_port=0, **{name: 0})


# -- HTTP parsing ---------------------------------------------------------


def test_parse_head() -> None:
    head = parse_head(
        b"POST /v2/models/my%20model/infer?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n"
        b"Inference-Header-Content-Length:  5 \r\n\r\n"
    )
    assert (head.method, head.path, head.query, head.version) == (
        "POST",
        "/v2/models/my model/infer",
        "x=1",
        "HTTP/1.1",
    )
    assert head.headers["inference-header-content-length"] == "5"
    assert head.content_length == 12 and head.keep_alive and not head.chunked
    assert not parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive
    assert not parse_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive
    chunked = parse_head(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert chunked.chunked and "content-length" not in chunked.headers


@pytest.mark.parametrize(
    ("head", "status", "message"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/2.0\r\n\r\n", 505, "protocol version"),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed header"),
        (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "invalid Content-Length"),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "conflicting"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "does not end with chunked"),
        (b"GET ftp://x/ HTTP/1.1\r\n\r\n", 400, "not a path"),  # an absolute-form target is http(s)
        (b"CONNECT x:80 HTTP/1.1\r\n\r\n", 400, "not a path"),  # authority-form: no proxy here
        (b"OPTIONS * HTTP/1.1\r\n\r\n", 400, "not a path"),
    ],
)
def test_parse_head_refuses(head: bytes, status: int, message: str) -> None:
    with pytest.raises(HttpParseError, match=message) as info:
        parse_head(head)
    assert info.value.status == status
    assert isinstance(info.value, InputError)


def test_response_head() -> None:
    head = response_head(200, [("content-type", "application/json")], 7, keep_alive=False)
    assert head == (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\nconnection: close\r\n\r\n"
    )


# -- HTTP listener ----------------------------------------------------------


def _echo(conn, head, body) -> None:
    """Answers the body back, read in place into a buffer (or whole when chunked)."""
    if body.chunked:
        data = body.read_all()
    else:
        buf = bytearray(body.remaining)
        body.readinto(memoryview(buf))
        data = bytes(buf)
    answer = json.dumps({"method": head.method, "path": head.path, "n": len(data)}).encode()
    conn.respond(200, [("content-type", "application/json")], [answer, memoryview(data)])


@pytest.fixture
def listener():
    door = HttpListener("127.0.0.1", 0, _echo)
    yield door
    door.close()


def _raw(port: int, data: bytes, read: int = 1 << 16) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(read)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_keep_alive_requests_and_large_bodies(listener: HttpListener) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=10)
    payload = np.random.default_rng(0).bytes(3 << 20)
    for body in (b"abc", payload, b""):
        conn.request("POST", "/v2/models/m/infer", body=body)
        response = conn.getresponse()
        data = response.read()
        assert response.status == 200 and not response.will_close
        head_length = data.index(b"}") + 1
        assert json.loads(data[:head_length]) == {
            "method": "POST",
            "path": "/v2/models/m/infer",
            "n": len(body),
        }
        assert data[head_length:] == body
    sock = conn.sock
    conn.request("GET", "/v2/health/live")
    conn.getresponse().read()
    assert conn.sock is sock  # one connection throughout
    conn.close()


def test_expect_continue_chunked_and_pipelined(listener: HttpListener) -> None:
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
        s.sendall(b"POST /a HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"wxyz")
        assert b'"n": 4}wxyz' in s.recv(1000)
    answer = _raw(
        listener.port,
        b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
        b"POST /d HTTP/1.1\r\nContent-Length: 1\r\nConnection: close\r\n\r\nZ",
    )
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert b'"path": "/c", "n": 5}abcde' in answer and b'"path": "/d", "n": 1}Z' in answer


def test_bad_requests_get_an_error_object_and_a_closed_connection(listener: HttpListener) -> None:
    answer = _raw(listener.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close" in answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"].startswith("malformed request line")
    answer = _raw(listener.port, b"GET / HTTP/1.1\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_close_stops_listening_and_ends_open_connections() -> None:
    door = HttpListener("127.0.0.1", 0, _echo)
    idle = socket.create_connection(("127.0.0.1", door.port), timeout=10)
    time.sleep(0.2)  # accepted
    door.close()
    assert idle.recv(10) == b""  # the server shut it
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", door.port), timeout=2).close()


def test_replicas_share_a_port_and_others_cannot_take_it() -> None:
    first = HttpListener("127.0.0.1", 0, _echo)
    try:
        second = HttpListener("127.0.0.1", first.port, _echo)  # SO_REUSEPORT: another replica
        second.close()
        with socket.socket() as plain:  # a program without SO_REUSEPORT cannot
            with pytest.raises(OSError):
                plain.bind(("127.0.0.1", first.port))
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(FrontDoorError, match="cannot listen for HTTP"):
                HttpListener("127.0.0.1", taken.getsockname()[1], _echo)
    finally:
        first.close()


def test_binds_only_the_host_it_is_given() -> None:
    door = HttpListener("127.0.0.1", 0, _echo)
    try:
        assert door._sock.getsockname()[0] == "127.0.0.1"
    finally:
        door.close()


# -- the KServe handler's error answers (its inference runs in the Ray integration tests) ---


class _RefusingClient:
    """A client whose every call is refused: the handler must answer Triton's error shape."""

    _recheck = False
    client = SimpleNamespace(_layout_or_none=lambda model: None)  # no slot layout: the general path

    def infer(self, model, inputs, **kwargs):
        raise InputError(f"model {model!r}: unexpected input")


def test_errors_have_tritons_shape_and_the_connection_survives() -> None:
    def delegate(head, data):
        return 404, [("content-type", "application/json")], b'{"error":"Not Found"}'

    def error_answer(error):
        return 400, json.dumps({"error": str(error)}).encode()

    handler = KServeHttpHandler(_RefusingClient(), lambda model: "1", delegate, error_answer, 1 << 26)
    door = HttpListener("127.0.0.1", 0, handler)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=10)
        body = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
        conn.request("POST", "/v2/models/m/infer", body=body)
        response = conn.getresponse()
        assert response.status == 400
        assert json.loads(response.read()) == {"error": "model 'm': unexpected input"}
        conn.request("GET", "/v2/nothing")
        response = conn.getresponse()
        assert (response.status, response.read()) == (404, b'{"error":"Not Found"}')
        conn.request("POST", "/v2/models/m/infer", body=b"{not json")
        response = conn.getresponse()
        assert response.status == 400 and "error" in json.loads(response.read())
        conn.close()
    finally:
        door.close()


# -- gRPC codec -------------------------------------------------------------


def test_split_infer_request_keeps_raw_contents_as_views() -> None:
    request = pb.ModelInferRequest(model_name="identity", id="7")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    tensor.parameters["k"].int64_param = 3
    request.outputs.add(name="OUTPUT0")
    raw = [np.arange(4, dtype=np.float32).tobytes(), b"\x01" * 300]
    request.raw_input_contents.extend(raw)
    data = request.SerializeToString()
    rest, views = split_infer_request(data)
    assert [bytes(v) for v in views] == raw
    assert all(isinstance(v, memoryview) and v.obj is data for v in views)
    assert not rest.raw_input_contents
    del request.raw_input_contents[:]
    assert rest == request
    with pytest.raises(InputError, match="malformed"):
        split_infer_request(data[:-5])
    with pytest.raises(InputError, match="malformed"):
        split_infer_request(b"\x0f\x00")


def test_raw_start_and_plan_inputs_read_a_requests_head() -> None:
    request = pb.ModelInferRequest(model_name="identity", id="7")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.inputs.add(name="INPUT1", datatype="INT8", shape=[3])
    request.outputs.add(name="OUTPUT0")
    request.raw_input_contents.extend([np.zeros(4, np.float32).tobytes(), b"abc"])
    data = request.SerializeToString()
    start = raw_start(data)
    assert start is not None and data[start] == 0x3A
    head = pb.ModelInferRequest.FromString(data[:start])
    assert [t.name for t in head.inputs] == ["INPUT0", "INPUT1"] and not head.raw_input_contents
    assert raw_start(data[: start - 1]) is None  # the head ends before the contents begin
    placeholders, outputs = plan_inputs(head)
    assert outputs == ["OUTPUT0"]
    assert {n: (a.shape, a.dtype, a.nbytes) for n, a in placeholders.items()} == {
        "INPUT0": ((1, 4), np.float32, 16),
        "INPUT1": ((3,), np.int8, 3),
    }
    assert all(a.strides == (0,) * a.ndim for a in placeholders.values())  # no memory behind them
    refused = [pb.ModelInferRequest(), pb.ModelInferRequest(), pb.ModelInferRequest(), pb.ModelInferRequest()]
    refused[0].inputs.add(name="T", datatype="BYTES", shape=[1])
    refused[1].inputs.add(name="A", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    refused[2].inputs.add(name="A", datatype="FP32", shape=[1]).parameters[
        "shared_memory_region"
    ].string_param = "r"
    for name in ("A", "A"):
        refused[3].inputs.add(name=name, datatype="FP32", shape=[1])
    assert [plan_inputs(r) for r in refused] == [None] * 4
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="A", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    assert raw_start(typed.SerializeToString()) is None


def test_encode_infer_response_parts_are_the_message_triton_sends() -> None:
    outputs = {
        "OUTPUT0": np.arange(6, dtype=np.float32).reshape(2, 3),
        "TEXT": np.array([b"ab", b""], dtype=object),
    }
    parts = encode_infer_response_parts("identity", "1", "req", outputs)
    assert np.shares_memory(np.asarray(parts[3]), outputs["OUTPUT0"])  # a view, not a copy
    data = b"".join(parts)
    response = pb.ModelInferResponse.FromString(data)
    assert (response.model_name, response.model_version, response.id) == ("identity", "1", "req")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("OUTPUT0", "FP32", [2, 3]),
        ("TEXT", "BYTES", [2]),
    ]
    assert response.raw_output_contents[0] == outputs["OUTPUT0"].tobytes()
    assert response.raw_output_contents[1] == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 1 << 35])
def test_varint(value: int) -> None:
    from ray_triton_shm._private.serve.protocol.grpc_infer_codec import _varint

    encoded = encode_varint(value)
    assert _varint(memoryview(encoded), 0) == (value, len(encoded))


def test_threads_end_with_the_listener() -> None:
    before = {t.name for t in threading.enumerate()}
    door = HttpListener("127.0.0.1", 0, _echo)
    conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=10)
    conn.request("GET", "/")
    conn.getresponse().read()
    door.close()
    conn.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and {t.name for t in threading.enumerate()} - before:
        time.sleep(0.05)
    assert not {t.name for t in threading.enumerate()} - before


def test_a_stalled_body_or_an_idle_connection_is_closed() -> None:
    seen: list[str] = []

    def handler(conn, head, body) -> None:
        try:
            body.readinto(memoryview(bytearray(body.remaining)))
        except BaseException as e:
            seen.append(type(e).__name__)
            raise
        conn.respond(200, [], [b"ok"])

    timeouts = HttpTimeouts(idle_s=0.5, body_grace_s=0.5)
    door = HttpListener("127.0.0.1", 0, handler, timeouts=timeouts)
    try:
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # 7 bytes never come
            answer = s.recv(1000)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
            assert s.recv(100) == b""
        assert seen == ["HttpTimeoutError"]
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\nab")
            assert s.recv(100).endswith(b"\r\n\r\nok")
            began = time.monotonic()
            assert s.recv(100) == b""  # idle: closed by the server
            assert time.monotonic() - began < 5
    finally:
        door.close()


class _Deployment:
    """What the front door reads of its deployment when it has only an HTTP port."""

    _client = None
    _max_request_bytes = 1 << 20


def test_another_application_cannot_share_a_front_door_port() -> None:
    # Replicas of one app share its ports (SO_REUSEPORT); a second app on the same port
    # would get half of the first one's connections, so it is refused and loses nothing.
    first = FrontDoor(FrontDoorConfig(http_port=0), _Deployment(), "first")
    port = first.http.port
    config = FrontDoorConfig(http_port=port)
    try:
        replica = FrontDoor(config, _Deployment(), "first")
        replica.close()
        with pytest.raises(FrontDoorError, match=f"port {port} is already the front door of another"):
            FrontDoor(config, _Deployment(), "second")
        other_port = FrontDoorConfig(http_port=0, grpc_port=None)
        FrontDoor(other_port, _Deployment(), "second").close()
        with pytest.raises(FrontDoorError, match=f"port {port} is already"):  # its gRPC port too
            FrontDoor(FrontDoorConfig(http_port=None, grpc_port=port), _Deployment(), "second")
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:  # the first still answers
            conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1")
    finally:
        first.close()
    FrontDoor(config, _Deployment(), "second").close()  # free again once the first app is gone


def test_a_port_claim_ends_with_its_process() -> None:
    claimer = subprocess.Popen(
        [sys.executable, "-c", _CLAIM_AND_WAIT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert claimer.stdout is not None and claimer.stdout.readline() == b"claimed\n"
        assert port_claims(_CLAIMED_PORT) == [app_digest("other")]
        with pytest.raises(FrontDoorError, match="already the front door of another"):
            PortClaim(_CLAIMED_PORT, "mine")
        assert port_claims(_CLAIMED_PORT) == [app_digest("other")]  # the refused claim is dropped
    finally:
        claimer.kill()
        claimer.wait()
    assert port_claims(_CLAIMED_PORT) == []
    with PortClaim(_CLAIMED_PORT, "mine") as claim:
        assert port_claims(_CLAIMED_PORT) == [app_digest("mine")]
        claim.close()  # idempotent with the exit's close
    assert port_claims(_CLAIMED_PORT) == []


_CLAIMED_PORT = 1  # never a front door's: claims are names only, nothing is bound on the port
_CLAIM_AND_WAIT = f"""
import sys
from ray_triton_shm._private.node.port_claim import PortClaim
claim = PortClaim({_CLAIMED_PORT}, "other")
print("claimed", flush=True)
sys.stdin.read()
"""
