"""The KServe v2 ingress against hostile clients, over HTTP and gRPC (a real Serve app, a real Triton).

Over-size bodies and gzip bombs, parser traps (deep nesting, huge integers,
absurd shapes), duplicate JSON keys that would smuggle a shared-memory region
past the ingress, uploads that trickle in while a good client waits, and
what an error answer may say when the node's Triton is gone.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
import requests
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from .conftest import CONFIG_FILE, free_port, teardown_ray

MAX_BODY = 1 << 26  # the default NodeConfig.max_request_bytes (Triton's own default HTTP input limit)
IDENTITY_SLOTS = 2
LEASE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    """(handle, HTTP base URL, gRPC address) of the app: one replica, two slots of ``identity``."""
    import ray

    from ray_triton_shm.serve import run_config_file

    spec = yaml.safe_load(CONFIG_FILE.read_text())
    port, grpc_port = free_port(), free_port()
    spec["http_options"]["port"] = port
    spec["grpc_options"]["port"] = grpc_port
    app = spec["applications"][0]
    app["args"]["quarantine_s"] = 1.0
    app["args"]["pools"]["identity"] = {
        "slots": IDENTITY_SLOTS,
        "max_batch_size": 1,
        "max_shapes": {"INPUT0": [1 << 20], "OUTPUT0": [1 << 20]},
        "lease_timeout_s": LEASE_TIMEOUT_S,
    }
    app["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1}]
    path = tmp_path_factory.mktemp("hostile") / "hostile.yaml"
    path.write_text(yaml.safe_dump(spec))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handles = run_config_file(str(path))
        base = f"http://127.0.0.1:{port}"
        _wait_for(lambda: requests.get(base + "/v2/health/ready", timeout=10).status_code == 200, 120)
        yield handles["triton"], base, f"127.0.0.1:{grpc_port}"
    finally:
        teardown_ray()


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.5)


def _error_text(response: requests.Response) -> str:
    body = json.loads(response.content)
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    return body["error"]


@pytest.fixture(scope="module")
def stub(ingress):
    channel = grpc.insecure_channel(
        ingress[2], options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    )
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        channel.close()


ADD_SUB = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [3] * 16},
    ]
}
ROUTES = ("/v2/models/add_sub/infer", "/v2/models/add_sub/versions/1/infer")


def _raw_http(port: int, head: bytes, body: bytes, timeout_s: float) -> bytes:
    """Send ``head`` (request line and headers) and ``body`` on a fresh connection; the answer's
    head and body (as much as its Content-Length says)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk
        top, _, rest = answer.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", top)
        while length and len(rest) < int(length.group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return top + b"\r\n\r\n" + rest


# -- body size and inflation --------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_a_huge_content_length_is_refused_before_the_body_is_read(ingress, route) -> None:
    _, base, _ = ingress
    port = int(base.rsplit(":", 1)[1])
    head = (
        f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**12}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answer = _raw_http(port, head, b'{"inputs": [', timeout_s=30)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert time.monotonic() - started < 20
    assert b"exceeds the maximum allowed" in answer, answer[:300]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413(ingress, route, chunked) -> None:
    _, base, _ = ingress
    data = b"{" + b" " * (MAX_BODY - 1) + b"}"
    payload = iter([data[: len(data) // 2], data[len(data) // 2 :]]) if chunked else data
    response = requests.post(base + route, data=payload, timeout=120)
    assert response.status_code == 413, response.content[:300]
    assert "exceeds the maximum allowed" in _error_text(response)
    # One byte less is read and parsed: refused as JSON without inputs (by Triton itself, on the
    # versioned route), not for its size.
    fits = requests.post(base + route, data=data[: MAX_BODY - 1] + b"}", timeout=120)
    assert fits.status_code in (400, 500) and "inputs" in _error_text(fits), fits.content[:300]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compression_bomb_is_refused_while_inflating(ingress, route, encoding) -> None:
    _, base, _ = ingress
    inflated = b" " * (MAX_BODY + (1 << 20))
    bomb = gzip.compress(inflated) if encoding == "gzip" else zlib.compress(inflated)
    assert len(bomb) < 1 << 20
    response = requests.post(base + route, data=bomb, headers={"Content-Encoding": encoding}, timeout=120)
    assert response.status_code == 413, response.content[:300]
    assert "exceeds the maximum allowed" in _error_text(response)
    # A compressed request that inflates within the limit is served as before.
    small = gzip.compress(json.dumps(ADD_SUB).encode()) if encoding == "gzip" else None
    if small is not None:
        ok = requests.post(base + route, data=small, headers={"Content-Encoding": "gzip"}, timeout=60)
        assert ok.status_code == 200, ok.content[:300]


# -- parser traps ------------------------------------------------------------------------------


def _shaped(shape: list[int]) -> bytes:
    entry = {"name": "INPUT0", "datatype": "INT32", "shape": shape, "data": []}
    return json.dumps({"inputs": [entry, ADD_SUB["inputs"][1]]}).encode()


PARSER_TRAPS = [
    ("nested-200000", b"[" * 200_000),
    ("nested-closed-200000", b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    (
        "int-5000-digits",
        b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": ['
        + b"9" * 5000
        + b"]}]}",
    ),
    (
        "shape-int-5000-digits",
        b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [' + b"7" * 5000 + b'], "data": []}]}',
    ),
    ("rank-100", _shaped([1] * 100)),
    ("rank-65-zero", _shaped([0] * 65)),
    ("dim-2**70", _shaped([0, 2**70])),
    ("dims-overflow-int64", _shaped([0, 2**62, 2**62])),
    ("dim-negative", _shaped([-1, 16])),
    ("nan-constant", b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [NaN]}]}'),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [t[1] for t in PARSER_TRAPS], ids=[t[0] for t in PARSER_TRAPS])
def test_parser_traps_are_400_over_http(ingress, route, body) -> None:
    _, base, _ = ingress
    response = requests.post(
        base + route, data=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.content[:300]
    assert _error_text(response)
    # The ingress is still serving.
    assert requests.post(base + ROUTES[0], json=ADD_SUB, timeout=60).status_code == 200


def _grpc_request(shape: list[int], raw: bytes = b"") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=shape)
    second = request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    del second
    request.raw_input_contents.extend([raw, np.zeros(16, np.int32).tobytes()])
    return request


GRPC_TRAPS = [
    ("rank-100", _grpc_request([1] * 100, np.zeros(1, np.int32).tobytes())),
    ("rank-65-zero", _grpc_request([0] * 65)),
    ("dims-overflow-int64", _grpc_request([0, 2**62, 2**62])),
    ("dims-product-overflow", _grpc_request([2**40, 2**40], b"")),
    ("dim-negative", _grpc_request([-1, 16])),
]


@pytest.mark.parametrize("version", ["", "1"])
@pytest.mark.parametrize("request_", [t[1] for t in GRPC_TRAPS], ids=[t[0] for t in GRPC_TRAPS])
def test_parser_traps_are_invalid_argument_over_grpc(stub, request_, version) -> None:
    message = pb.ModelInferRequest()
    message.CopyFrom(request_)
    message.model_version = version
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(message, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())


# -- duplicate keys -----------------------------------------------------------------------------


def _smuggling_bodies(region: str) -> list[tuple[str, str]]:
    """Requests whose first copy of a key names ``region`` (what Triton reads) and whose last does not."""
    data = json.dumps(list(range(16)))
    first = f'{{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": {data}'
    second = json.dumps(ADD_SUB["inputs"][1])
    shm = json.dumps({"shared_memory_region": region, "shared_memory_byte_size": 64})
    clean = json.dumps(ADD_SUB["inputs"])
    output = f'{{"name": "OUTPUT0", "parameters": {shm}, "parameters": {{}}}}'
    return [
        ("input-parameters", f'{{"inputs": [{first}, "parameters": {shm}, "parameters": {{}}}}, {second}]}}'),
        ("output-parameters", f'{{"inputs": {clean}, "outputs": [{output}]}}'),
        ("inputs", f'{{"inputs": [{first}, "parameters": {shm}}}, {second}], "inputs": {clean}}}'),
    ]


def test_duplicate_keys_cannot_smuggle_a_region_to_triton(ingress) -> None:
    import ray

    from ray_triton_shm.node import get_node_actor

    _, base, _ = ingress
    assert requests.post(base + ROUTES[0], json=ADD_SUB, timeout=60).status_code == 200
    info = ray.get(get_node_actor().info.remote())
    regions = sorted(
        n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{info.actor_pid}_") and "_node_" in n
    )
    assert regions, info.actor_pid
    for name, body in _smuggling_bodies(regions[0]):
        for route in ROUTES:
            response = requests.post(base + route, data=body.encode(), timeout=60)
            assert response.status_code == 400, (name, route, response.content[:300])
            assert "duplicate" in _error_text(response), (name, route, response.content[:300])


# -- slow uploads ------------------------------------------------------------------------------


def _binary_identity(n: int) -> tuple[bytes, bytes]:
    """(JSON header, tensor bytes) of a binary identity request of ``n`` FP32 values."""
    header = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, n], "parameters": {"binary_data_size": 4 * n}}
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
    return json.dumps(header).encode(), np.arange(n, dtype=np.float32).tobytes()


class Trickler(threading.Thread):
    """A client that sends a binary request's header, then its tensor bytes one byte a second."""

    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        head, tail = _binary_identity(n)
        self.port = port
        self.request = (
            (
                "POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
                f"Inference-Header-Content-Length: {len(head)}\r\n"
                f"Content-Length: {len(head) + len(tail)}\r\n\r\n"
            ).encode()
            + head
            + tail[:1024]
        )
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(self.request)
            while not self.stop.wait(1.0):
                try:
                    sock.sendall(b"\0")
                except OSError:
                    return
                self.sent += 1


def _good_request(base: str, n: int) -> tuple[int, float]:
    head, tail = _binary_identity(n)
    started = time.monotonic()
    response = requests.post(
        base + "/v2/models/identity/infer",
        data=head + tail,
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=60,
    )
    if response.status_code == 200:
        length = int(response.headers["inference-header-content-length"])
        assert np.array_equal(
            np.frombuffer(response.content[length:], np.float32), np.frombuffer(tail, np.float32)
        )
    return response.status_code, time.monotonic() - started


def test_trickling_uploads_do_not_starve_a_good_client(ingress, stub) -> None:
    handle, base, _ = ingress
    port = int(base.rsplit(":", 1)[1])
    n = 64 * 1024  # 256 KB: the body goes into a slot (above the gRPC threshold), one slot a request
    assert _good_request(base, n)[0] == 200  # the pool exists
    tricklers = [Trickler(port, n) for _ in range(IDENTITY_SLOTS + 3)]
    for t in tricklers:
        t.start()
    try:
        time.sleep(3.0)  # every trickler's header has arrived; each sends a byte a second
        assert all(t.is_alive() for t in tricklers)
        for _ in range(3):
            code, took = _good_request(base, n)
            assert code == 200 and took < LEASE_TIMEOUT_S, (code, took)
        x = np.arange(n, dtype=np.float32).reshape(1, n)
        grpc_request = pb.ModelInferRequest(model_name="identity")
        grpc_request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, n])
        grpc_request.raw_input_contents.append(x.tobytes())
        answer = stub.ModelInfer(grpc_request, timeout=LEASE_TIMEOUT_S)
        assert np.array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32), x.ravel())
        assert all(t.is_alive() and t.sent > 0 for t in tricklers)
    finally:
        for t in tricklers:
            t.stop.set()
        for t in tricklers:
            t.join(timeout=10)
    # Every slot comes back once the tricklers are gone.
    _wait_for(lambda: handle.whereami.remote().result()["busy"].get("identity", 0) == 0, 30)
    assert _good_request(base, n)[0] == 200


# -- what error answers say --------------------------------------------------------------------

_ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?|\b(?:ipv4|ipv6|unix):|localhost:\d+")


def test_error_answers_name_no_addresses_nodes_or_slots(ingress, stub) -> None:
    """With the node's Triton killed, every failed answer over HTTP and gRPC says nothing internal."""
    handle, base, _ = ingress
    where = handle.whereami.remote().result()
    secrets = [where["node_id"], where["triton_node_id"], where["grpc_url"], "slots", "in use by"]
    grpc_request = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        grpc_request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        grpc_request.raw_input_contents.append(np.zeros(16, np.int32).tobytes())
    os.kill(where["triton_pid"], signal.SIGKILL)
    http_errors: list[tuple[int, str]] = []
    grpc_errors: list[tuple[str, str]] = []
    deadline = time.monotonic() + 120
    recovered = False
    while time.monotonic() < deadline and not recovered:
        response = requests.post(base + ROUTES[0], json=ADD_SUB, timeout=60)
        if response.status_code == 200:
            recovered = bool(http_errors)
        else:
            http_errors.append((response.status_code, _error_text(response)))
        try:
            stub.ModelInfer(grpc_request, timeout=60)
        except grpc.RpcError as e:
            grpc_errors.append((e.code().name, e.details() or ""))
        time.sleep(0.2)
    assert http_errors and grpc_errors, "the killed Triton never failed a request"
    # 503 while Triton is down; Triton's own 404 while it loads its models again.
    assert {code for code, _ in http_errors} <= {404, 503}, sorted(set(http_errors))
    for _, text in http_errors + grpc_errors:
        assert not _ADDRESS.search(text), text
        for secret in secrets:
            assert secret not in text, (secret, text)
    _wait_for(lambda: requests.get(base + "/v2/health/ready", timeout=10).status_code == 200, 120)
