"""The front door: each app's replicas listening themselves, reached by unmodified tritonclient.

deployments/two_apps.yaml (two apps, their front doors on free ports), a local
Ray and the node's real Triton. Every answer is compared with the node's
Triton's own; the listeners bind only the configured host and are gone with
the apps, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.helpers import H2_PREFACE, h2_frame, h2_request_block, metric_value, scrape_prometheus, wait_for

from .conftest import (
    REPO,
    free_port,
    frontdoor_on_free_ports,
    http_identity,
    init_ray,
    replica_log,
    teardown_ray,
    workers_stderr,
)

TWO_APPS = REPO / "deployments" / "two_apps.yaml"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
FRONTDOOR_REQUESTS = "ray_triton_shm_frontdoor_requests_total"


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """{app name: (handle, HTTP address, gRPC address)} and the node's Triton (HTTP, gRPC)."""
    import ray

    from ray_triton_shm.serve import run_config_file

    spec = frontdoor_on_free_ports(yaml.safe_load(TWO_APPS.read_text()))
    spec["http_options"]["port"] = free_port()
    doors = {a["name"]: a["args"]["frontdoor"] for a in spec["applications"]}
    for application in spec["applications"]:
        application["args"]["pools"]["identity"]["max_shapes"] = {"INPUT0": [262144], "OUTPUT0": [262144]}
    path = tmp_path_factory.mktemp("frontdoor") / "two_apps.yaml"
    path.write_text(yaml.safe_dump(spec))
    metrics_port = free_port()
    init_ray(metrics_port)
    try:
        handles = run_config_file(str(path))
        where = handles["triton-a"].whereami.remote().result()
        from ray_triton_shm.node import get_node_actor

        info = ray.get(get_node_actor().info.remote())
        yield {
            "apps": {
                name: (handles[name], f"127.0.0.1:{door['http_port']}", f"127.0.0.1:{door['grpc_port']}")
                for name, door in doors.items()
            },
            "triton": (info.http_url, info.grpc_url),
            "where": where,
            "metrics_port": metrics_port,
        }
    finally:
        teardown_ray()


def _grpc_identity(url: str, x: np.ndarray, headers: dict[str, str] | None = None) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("identity", [tensor], headers=headers).as_numpy("OUTPUT0")
    finally:
        client.close()


def test_unmodified_tritonclients_get_correct_outputs(apps) -> None:
    rng = np.random.default_rng(27)
    for _, http_url, grpc_url in apps["apps"].values():
        for n in (16, 262144):  # small, and 1 MB (through a slot)
            x = rng.random((1, n), dtype=np.float32)
            assert np.array_equal(http_identity(http_url, x), x)
            assert np.array_equal(_grpc_identity(grpc_url, x), x)
        x = rng.random((1, 64), dtype=np.float32)
        assert np.array_equal(http_identity(http_url, x, binary=False), x)
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        for module, url in ((httpclient, http_url), (grpcclient, grpc_url)):
            client = module.InferenceServerClient(url)
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                tensor = module.InferInput(name, [2, 16], "INT32")
                tensor.set_data_from_numpy(a)
                inputs.append(tensor)
            result = client.infer("add_sub", inputs)
            assert np.array_equal(result.as_numpy("OUTPUT0"), 2 * a)
            assert np.array_equal(result.as_numpy("OUTPUT1"), 0 * a)
            assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_sub")
            client.close()


def _http_error(url: str, model: str, x: np.ndarray, datatype: str = "FP32") -> tuple[str | None, str]:
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT0", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    try:
        client.infer(model, [tensor])
    except InferenceServerException as e:
        return e.status(), e.message()
    finally:
        client.close()
    raise AssertionError("no error")


def _grpc_error(url: str, model: str, x: np.ndarray, datatype: str = "FP32") -> tuple[str | None, str]:
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("INPUT0", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    try:
        client.infer(model, [tensor])
    except InferenceServerException as e:
        return e.status(), e.message()
    finally:
        client.close()
    raise AssertionError("no error")


def test_bad_requests_get_tritons_error_shape(apps) -> None:
    _, http_url, grpc_url = apps["apps"]["triton-a"]
    triton_http, triton_grpc = apps["triton"]
    x = np.ones((1, 16), np.float32)
    # An unknown model: Triton's own status and message, over both protocols.
    assert _http_error(http_url, "nope", x) == _http_error(triton_http, "nope", x)
    assert _grpc_error(grpc_url, "nope", x) == _grpc_error(triton_grpc, "nope", x)
    # A wrong datatype: a 400 / INVALID_ARGUMENT with a message, as Triton.
    wrong = np.ones((1, 16), np.int32)
    ours, theirs = (
        _http_error(http_url, "identity", wrong, "INT32"),
        _http_error(triton_http, "identity", wrong, "INT32"),
    )
    assert ours[0] == theirs[0] == "400" and ours[1]
    ours, theirs = (
        _grpc_error(grpc_url, "identity", wrong, "INT32"),
        _grpc_error(triton_grpc, "identity", wrong, "INT32"),
    )
    assert ours[0] == theirs[0] == "StatusCode.INVALID_ARGUMENT" and ours[1]


def test_each_app_has_its_own_ports_and_the_application_header_is_checked(apps) -> None:
    (handle_a, http_a, grpc_a), (handle_b, http_b, grpc_b) = (
        apps["apps"]["triton-a"],
        apps["apps"]["triton-b"],
    )
    assert len({http_a, grpc_a, http_b, grpc_b}) == 4
    assert handle_a.frontdoor_ports.remote().result()["http"] == int(http_a.rsplit(":", 1)[1])
    assert handle_b.frontdoor_ports.remote().result()["grpc"] == int(grpc_b.rsplit(":", 1)[1])
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    assert np.array_equal(_grpc_identity(grpc_a, x, headers={"application": "triton-a"}), x)
    with pytest.raises(InferenceServerException) as info:
        _grpc_identity(grpc_a, x, headers={"application": "triton-b"})
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "'triton-b' is not served on this port" in info.value.message()
    client = grpcclient.InferenceServerClient(grpc_b)
    with pytest.raises(InferenceServerException, match="'triton-a' is not served on this port"):
        client.is_server_live(headers={"application": "triton-a"})
    client.close()


def _listeners(ports: set[int]) -> list:
    return [
        c
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    ]


def _ports(apps) -> set[int]:
    return {int(url.rsplit(":", 1)[1]) for _, http, grpc in apps["apps"].values() for url in (http, grpc)}


def test_the_listeners_bind_only_the_configured_host(apps) -> None:
    listening = _listeners(_ports(apps))
    assert {c.laddr.port for c in listening} == _ports(apps)
    # gRPC binds an IPv6 socket with the v4-mapped address: still 127.0.0.1 only.
    assert {c.laddr.ip.removeprefix("::ffff:") for c in listening} == {"127.0.0.1"}
    others = [
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET
    ]
    for address in others:
        if address.startswith("127."):
            continue
        with socket.socket() as s:  # not reachable on the machine's other addresses
            s.settimeout(2)
            assert s.connect_ex((address, min(_ports(apps)))) != 0


def _busy_slots() -> dict[str, int]:
    import ray

    from ray_triton_shm.node import get_node_actor

    pools = ray.get(get_node_actor().status.remote(), timeout=60)["pools"]
    return {model: p["slots"] - p["free"] for model, p in pools.items() if p["slots"] != p["free"]}


def test_callers_gone_mid_answer_give_their_slots_back(apps) -> None:
    """Callers that reset their connection while their 1 MB answer is being written from the slot:
    the write fails, and every slot is free again without any further request."""
    _, http_url, _ = apps["apps"]["triton-a"]
    host, port = http_url.rsplit(":", 1)
    n = 262144
    body = np.ones((1, n), np.float32).tobytes()
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[1,%d],"datatype":"FP32","parameters":{"binary_data_size":%d}}],'
        b'"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}' % (n, len(body))
    )
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
    ) % (len(header), len(header) + len(body))
    assert np.array_equal(http_identity(http_url, np.ones((1, n), np.float32)), np.ones((1, n), np.float32))
    for _ in range(16):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head + header + body)
            s.recv(1024)  # the answer has begun
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
    deadline = time.monotonic() + 30
    while _busy_slots() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _busy_slots(), "slots held after their callers were gone"
    assert np.array_equal(http_identity(http_url, np.ones((1, n), np.float32)), np.ones((1, n), np.float32))


def test_a_stalled_body_gives_its_slot_back_at_once(apps) -> None:
    """A caller that stops halfway through its tensor bytes: the slot is free again within
    ``http_slot_stall_s`` (1 s) while the caller is still connected, and its answer is right."""
    _, http_url, _ = apps["apps"]["triton-a"]
    host, port = http_url.rsplit(":", 1)
    n = 262144
    x = np.arange(n, dtype=np.float32).reshape(1, n)
    body = x.tobytes()
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[1,%d],"datatype":"FP32","parameters":{"binary_data_size":%d}}],'
        b'"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}' % (n, len(body))
    )
    head = (
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    ) % (len(header), len(header) + len(body))
    assert np.array_equal(http_identity(http_url, x), x)  # the pool is made, its layout known
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + header + body[: len(body) // 2])
        time.sleep(2.5)
        assert not _busy_slots(), "a slot held by a body that stalled"
        s.sendall(body[len(body) // 2 :])
        answer = b""
        while chunk := s.recv(1 << 20):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert np.array_equal(np.frombuffer(answer[-len(body) :], np.float32).reshape(1, n), x)


def _infer_message(n: int, raw: bytes, tail: bytes = b"") -> bytes:
    """A serialised ``ModelInferRequest`` of identity, an FP32 ``[1, n]`` input with ``raw`` as contents."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="identity")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, n])
    request.raw_input_contents.append(raw)
    return request.SerializeToString() + tail


def test_grpc_requests_read_into_a_slot_odd_or_cut_short_lose_nothing(apps) -> None:
    """The gRPC front door reads a request's raw contents into a slot as they arrive; a message
    that turns out otherwise gets the answer of the same message read whole, and a call cut
    short mid-message gives its slot back."""
    import grpc

    _, _, grpc_url = apps["apps"]["triton-a"]
    n = 262144
    x = np.arange(n, dtype=np.float32)
    with grpc.insecure_channel(grpc_url, options=[("grpc.max_receive_message_length", -1)]) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        answer = infer(_infer_message(n, x.tobytes()), timeout=60)
        from tritonclient.grpc import service_pb2 as pb

        out = pb.ModelInferResponse.FromString(answer)
        assert np.array_equal(np.frombuffer(out.raw_output_contents[0], np.float32), x)
        # 4 bytes short, with a 4-byte field after: as long as expected, but its length differs.
        odd = _infer_message(n, x.tobytes()[:-4], tail=b"\x1a\x02id")
        assert len(odd) == len(_infer_message(n, x.tobytes()))
        errors = []
        for compression in (None, grpc.Compression.Gzip):  # compressed: read whole, never placed
            with pytest.raises(grpc.RpcError) as info:
                infer(odd, timeout=60, compression=compression)
            errors.append((info.value.code(), info.value.details()))
        assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT
    # Cut short: the head and part of the contents, then the stream is reset (or the connection closed).
    host, port = grpc_url.rsplit(":", 1)
    block = h2_request_block("/inference.GRPCInferenceService/ModelInfer")
    message = _infer_message(n, x.tobytes())
    framed = b"\x00" + len(message).to_bytes(4, "big") + message[: len(message) // 2]
    preface = H2_PREFACE + h2_frame(0, 4, 0, 0) + h2_frame(0, 4, 1, 0)  # SETTINGS, and the server's ACKed
    for reset in (True, False):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            opening = preface + h2_frame(len(block), 1, 4, 1) + block
            s.sendall(opening + h2_frame(len(framed), 0, 0, 1) + framed)
            deadline = time.monotonic() + 30
            while not _busy_slots() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _busy_slots(), "no slot was leased for the message while it arrived"
            if reset:
                s.sendall(h2_frame(4, 3, 0, 1) + (8).to_bytes(4, "big"))  # RST_STREAM, CANCEL
                time.sleep(0.5)
        deadline = time.monotonic() + 30
        while _busy_slots() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _busy_slots(), "a slot held after its call was cut short"
    assert np.array_equal(_grpc_identity(grpc_url, x.reshape(1, n)), x.reshape(1, n))


def test_stalled_grpc_clients_outnumbering_the_slots_stop_no_other_caller(apps) -> None:
    """Clients that stall mid-message, and clients that open no window for their answer, more of
    them than the model has slots: legitimate HTTP and gRPC callers of the same model go on being
    answered, and every slot is free again once the stalled clients hold them no longer."""
    _, http_url, grpc_url = apps["apps"]["triton-a"]
    host, port = grpc_url.rsplit(":", 1)
    n = 262144
    x = np.arange(n, dtype=np.float32)
    message = _infer_message(n, x.tobytes())
    block = h2_request_block("/inference.GRPCInferenceService/ModelInfer")
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    no_window = h2_frame(6, 4, 0, 0) + struct.pack(">HI", 4, 0)  # SETTINGS_INITIAL_WINDOW_SIZE = 0
    attackers = []
    try:
        for i in range(12):  # the identity pool has 4 slots
            s = socket.create_connection((host, int(port)), timeout=30)
            preface = H2_PREFACE
            if i % 2:  # stalls halfway through its message
                s.sendall(preface + h2_frame(0, 4, 0, 0) + h2_frame(len(block), 1, 4, 1) + block)
                half = framed[: len(framed) // 2]
                s.sendall(h2_frame(len(half), 0, 0, 1) + half)
            else:  # sends its whole message, then opens no window for the answer (and reads nothing)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(preface + no_window + h2_frame(len(block), 1, 4, 1) + block)
                s.sendall(h2_frame(len(framed), 0, 1, 1) + framed)
            attackers.append(s)
        time.sleep(0.5)
        started = time.monotonic()
        for _ in range(5):  # while the attackers still hold their connections
            y = np.random.default_rng().random((1, n), dtype=np.float32)
            assert np.array_equal(_grpc_identity(grpc_url, y), y)
            assert np.array_equal(http_identity(http_url, y), y)
        assert time.monotonic() - started < 60
        deadline = time.monotonic() + 30
        while _busy_slots() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _busy_slots(), "slots held at the stalled clients' pace"
    finally:
        for s in attackers:
            s.close()
    assert np.array_equal(_grpc_identity(grpc_url, x.reshape(1, n)), x.reshape(1, n))


def test_the_replicas_memory_stays_put_under_announced_sizes_and_idle_sockets(apps) -> None:
    """32 gRPC messages announcing 60 MB each (sending 200 KB, then nothing) and 300 idle
    sockets: the replica's RSS grows by a few MB, not by what the clients announce, and a
    caller is still answered meanwhile."""
    handle, _, grpc_url = apps["apps"]["triton-a"]
    pid = handle.whereami.remote().result()["pid"]
    replica = psutil.Process(pid)
    host, port = grpc_url.rsplit(":", 1)
    block = h2_request_block("/inference.GRPCInferenceService/ServerLive")
    announced = 60 * 1024 * 1024
    sent = b"\x00" + announced.to_bytes(4, "big") + b"\x01" * 200_000
    before = replica.memory_info().rss
    sockets = []
    try:
        for _ in range(16):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(H2_PREFACE + h2_frame(0, 4, 0, 0))
            for stream in (1, 3):
                opening = h2_frame(len(block), 1, 4, stream) + block
                s.sendall(opening + h2_frame(len(sent), 0, 0, stream) + sent)
            sockets.append(s)
        for _ in range(300):
            sockets.append(socket.create_connection((host, int(port)), timeout=30))
        time.sleep(3)
        grown = replica.memory_info().rss - before
        x = np.arange(1024, dtype=np.float32).reshape(1, 1024)
        assert np.array_equal(_grpc_identity(grpc_url, x), x)
    finally:
        for s in sockets:
            s.close()
    # What the clients announced: 32 x 60 MB = 1.9 GB; what they sent: 6.4 MB.
    assert grown < 100 * 1024 * 1024, f"the replica grew by {grown / 2**20:.0f} MiB"


def _door_counts(port: int, app: str, cells) -> list[float]:
    """The front-door request counter of ``app`` for each (protocol, method, route, status) of ``cells``."""
    samples = scrape_prometheus(port)
    return [
        metric_value(
            samples,
            FRONTDOOR_REQUESTS,
            application=app,
            deployment="TritonDeployment",
            protocol=protocol,
            method=method,
            route=route,
            status_code=status,
        )
        or 0.0
        for protocol, method, route, status in cells
    ]


def test_calls_are_in_serves_metrics_and_the_replicas_log(apps) -> None:
    """Each call counts in Ray's Prometheus metrics with Serve's labels and has its access-log line in
    the replica's log, as Serve's own requests do; the library's own lines are in that log too."""
    app = "triton-b"
    _, http_url, grpc_url = apps["apps"][app]
    x = np.ones((1, 16), dtype=np.float32)
    cells = [
        ("http", "POST", "/v2/models/identity/infer", "200"),
        ("grpc", "ModelInfer", MODEL_INFER, "OK"),
        ("http", "POST", "/v2/models/nonesuch/infer", "404"),
    ]
    lines = [
        "POST /v2/models/identity/infer 200 ",
        f"gRPC {MODEL_INFER} OK ",
        "POST /v2/models/nonesuch/infer 404 ",
    ]
    calls = [3, 2, 1]
    port = apps["metrics_port"]
    before = _door_counts(port, app, cells)
    logged_before = [replica_log(app).count(line) for line in lines]
    for _ in range(calls[0]):
        assert np.array_equal(http_identity(http_url, x), x)
    for _ in range(calls[1]):
        assert np.array_equal(_grpc_identity(grpc_url, x), x)
    assert _http_error(http_url, "nonesuch", x)[0] == "404"  # as Triton answers
    want = [b + n for b, n in zip(before, calls)]
    assert wait_for(lambda: _door_counts(port, app, cells) == want, 60, 1.0), (
        before,
        _door_counts(port, app, cells),
        sorted({n for n, _, _ in scrape_prometheus(port) if "frontdoor" in n}),
    )
    samples = scrape_prometheus(port)
    latency = metric_value(
        samples,
        "ray_triton_shm_frontdoor_latency_ms_count",
        application=app,
        protocol="grpc",
        status_code="OK",
    )
    assert latency is not None and latency >= calls[1]
    assert wait_for(
        lambda: (
            [replica_log(app).count(line) for line in lines] == [b + n for b, n in zip(logged_before, calls)]
        ),
        30,
        0.5,
    ), [replica_log(app).count(line) for line in lines]
    stderr = workers_stderr()  # as Serve's own access lines: not sent to the driver's console
    assert not [line for line in lines if line in stderr], [line for line in lines if line in stderr]
    log = replica_log(app)
    assert "front door on 127.0.0.1: HTTP port" in log
    assert "replica on node" in log and "uses Triton" in log


def test_status_lists_each_replicas_front_door(apps) -> None:
    """The node actor's status (``ray-triton-shm status``) has each replica's door, its ports and
    calls, for a fixed replica count too (Serve asks for autoscaling stats only when it autoscales)."""
    import ray

    from ray_triton_shm.node import get_node_actor

    app = "triton-a"
    handle, http_url, grpc_url = apps["apps"][app]
    pid = handle.whereami.remote().result()["pid"]
    ports = {"http_port": int(http_url.rsplit(":", 1)[1]), "grpc_port": int(grpc_url.rsplit(":", 1)[1])}
    x = np.ones((1, 16), dtype=np.float32)
    assert np.array_equal(http_identity(http_url, x), x)
    calls = handle.frontdoor_stats.remote().result()["calls"]

    def door() -> dict | None:
        doors = ray.get(get_node_actor().status.remote(), timeout=60)["frontdoors"]
        return next((d for d in doors if d.get("app") == app and d.get("pid") == pid), None)

    assert wait_for(lambda: (door() or {}).get("calls", 0) >= calls, 30, 0.5), door()
    seen = door()
    assert {k: seen[k] for k in ports} == ports and seen["refused"] == 0


def test_after_shutdown_nothing_listens_and_nothing_is_left(apps) -> None:
    """Last in this module: it shuts the apps down."""
    import ray
    from ray import serve

    from ray_triton_shm.node import shutdown_node_actors

    where = apps["where"]
    replicas = {h.whereami.remote().result()["pid"] for h, _, _ in apps["apps"].values()}
    serve.shutdown()
    shutdown_node_actors()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        _listeners(_ports(apps)) or any(psutil.pid_exists(p) for p in replicas)
    ):
        time.sleep(0.5)
    assert not _listeners(_ports(apps))
    for port in _ports(apps):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    assert not [p for p in replicas if psutil.pid_exists(p)], "a replica process outlived serve.shutdown()"
    owners = {where["actor_pid"], where["triton_pid"], *replicas}
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)]
    assert not left, left
    assert ray.is_initialized()
