"""The Serve app's KServe v2 ingress against Triton's own HTTP endpoint, request for request.

The app runs under ``route_prefix: /triton``, and each test runs twice: through
Serve's HTTP proxy and through the app's front door (the replica's own HTTP
listener, no prefix there). Every answer it gives is compared
with what a real Triton (the ``triton_server`` fixture, same model repository)
answers to the same request: status code and JSON body. Where Triton itself
answers a malformed request with 500, the ingress answers 400 (every bad
input is a client error); the message then is ours, the shape Triton's.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import yaml

from tests.helpers import free_port, stop_process

from .conftest import CONFIG_FILE, frontdoor_on_free_ports, local_ray

PREFIX = "/triton"
# The sleep pool's lease timeout (how long a request waits for its one slot; 30 s by default)
# and a request that holds the slot well past it.
SLEEP_LEASE_TIMEOUT_S = 4.0
SLEEP_HOLD_S = 12.0


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(handle, base URL of the app behind Serve's proxy, base URL of the app's front door)."""
    from ray_triton_shm.serve import run_config_file

    spec = frontdoor_on_free_ports(yaml.safe_load(CONFIG_FILE.read_text()))
    port = free_port()
    spec["http_options"]["port"] = port
    spec["grpc_options"]["port"] = free_port()
    app = spec["applications"][0]
    app["route_prefix"] = PREFIX
    app["args"]["quarantine_s"] = 1.0
    app["args"]["slots_per_model"] = 1
    app["args"]["pools"]["sleep"] = {"slots": 1, "lease_timeout_s": SLEEP_LEASE_TIMEOUT_S}
    app["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1}]
    path = tmp_path_factory.mktemp("ingress") / "ingress.yaml"
    path.write_text(yaml.safe_dump(spec))
    with local_ray():
        handles = run_config_file(str(path))
        base = f"http://127.0.0.1:{port}{PREFIX}"
        front = f"http://127.0.0.1:{app['args']['frontdoor']['http_port']}"
        wait_for(lambda: requests.get(base + "/v2/health/ready", timeout=10).status_code == 200, 120)
        yield handles["triton"], base, front


@pytest.fixture(params=["serve", "frontdoor"])
def ingress(request, deployed):
    """(handle, base URL): the app behind Serve's proxy (under its prefix), then its front door."""
    handle, base, front = deployed
    return handle, base if request.param == "serve" else front


@pytest.fixture(scope="module")
def triton(triton_server) -> str:
    return f"http://{triton_server.http_url}"


def wait_for(condition, timeout_s: float) -> None:
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


def answer(response: requests.Response) -> tuple[int, object]:
    """Status and body (parsed JSON; ``None`` for an empty one)."""
    return response.status_code, (json.loads(response.content) if response.content else None)


def assert_error_object(response: requests.Response) -> str:
    """The body is exactly ``{"error": "<text>"}`` and says nothing of Ray; returns the text."""
    body = json.loads(response.content)
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    for leak in ("ray::", "Traceback", "actor_id", "pid=", "\x1b[", "RayTaskError", "rtshm_"):
        assert leak not in body["error"], body
    return body["error"]


ADD_SUB = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [3] * 16},
    ]
}


# -- routes, metadata, config, readiness ------------------------------------------------------

SAME_GET = [
    "/v2/health/ready",
    "/v2/health/live",
    "/v2/models/add_sub",
    "/v2/models/add_sub/config",
    "/v2/models/add_sub/ready",
    "/v2/models/add_sub/versions/1",
    "/v2/models/add_sub/versions/1/config",
    "/v2/models/add_sub/versions/1/ready",
    "/v2/models/add_sub/versions/7",
    "/v2/models/add_sub/versions/7/config",
    "/v2/models/add_sub/versions/7/ready",
    "/v2/models/identity",
    "/v2/models/nope",
    "/v2/models/nope/config",
    "/v2/models/nope/ready",
    "/v2/bogus",
    "/v2/models/add_sub/bogus",
    "/v2/health/ready/",
    "/",
]


@pytest.mark.parametrize("path", SAME_GET)
def test_get_answers_exactly_as_triton(ingress, triton, path: str) -> None:
    _, base = ingress
    ours = requests.get(base + path, timeout=60)
    theirs = requests.get(triton + path, timeout=60)
    assert answer(ours) == answer(theirs)
    if ours.status_code >= 400:
        assert_error_object(ours)


def test_metadata_shapes_and_config_dims_are_integers(ingress) -> None:
    _, base = ingress
    metadata = requests.get(base + "/v2/models/add_sub", timeout=60).json()
    assert [t["shape"] for t in metadata["inputs"]] == [[-1, 16], [-1, 16]]
    config = requests.get(base + "/v2/models/add_sub/config", timeout=60).json()
    assert config["max_batch_size"] == 8
    assert [t["dims"] for t in config["input"]] == [[16], [16]]
    # What clients do with it: build inputs from the metadata and infer.
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    try:
        assert client.is_server_ready() and client.is_model_ready("add_sub")
        assert not client.is_model_ready("add_sub", "7")
        inputs = []
        for spec in client.get_model_metadata("add_sub")["inputs"]:
            shape = [2 if d == -1 else d for d in spec["shape"]]
            tensor = httpclient.InferInput(spec["name"], shape, spec["datatype"])
            tensor.set_data_from_numpy(np.full(shape, 5, dtype=np.int32))
            inputs.append(tensor)
        result = client.infer("add_sub", inputs, model_version="1")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((2, 16), 10, np.int32))
        assert result.get_response()["model_version"] == "1"
    finally:
        client.close()


def test_routes_live_under_the_prefix_only(deployed) -> None:
    _, base, _ = deployed
    root = base.removesuffix(PREFIX)
    assert requests.get(base + "/v2/health/ready", timeout=30).status_code == 200
    assert requests.get(root + "/v2/health/ready", timeout=30).status_code == 404
    assert requests.get(base + "/v2/models/stats", timeout=30).status_code == 200
    assert requests.get(root + "/v2/models/stats", timeout=30).status_code == 404


def test_server_metadata_is_tritons_with_the_extensions_served(ingress, triton) -> None:
    _, base = ingress
    ours = requests.get(base + "/v2", timeout=30).json()
    theirs = requests.get(triton + "/v2", timeout=30).json()
    # No explicit model control here: the repository extensions are not served.
    served = ["model_configuration", "binary_tensor_data", "statistics"]
    assert ours == {"name": "triton", "version": theirs["version"], "extensions": served}


def test_model_control_is_refused_without_explicit_mode(ingress, triton) -> None:
    """Loads and unloads are Triton's 503 with a message that says why; the index is Triton's."""
    _, base = ingress
    for action in ("load", "unload"):
        ours = requests.post(f"{base}/v2/repository/models/add_sub/{action}", timeout=60)
        theirs = requests.post(f"{triton}/v2/repository/models/add_sub/{action}", timeout=60)
        assert ours.status_code == theirs.status_code == 503
        message = assert_error_object(ours)
        assert f"cannot {action} model 'add_sub'" in message and "model_control: explicit" in message
    index = [requests.post(url + "/v2/repository/index", timeout=60) for url in (base, triton)]
    assert answer(index[0]) == answer(index[1])


# -- inference ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/add_sub/infer",
        "/v2/models/add_sub/versions/1/infer",
        "/v2/models/add_sub/versions/7/infer",
        "/v2/models/nope/infer",
        "/v2/models/nope/versions/1/infer",
    ],
)
def test_infer_answers_exactly_as_triton(ingress, triton, path: str) -> None:
    _, base = ingress
    ours = requests.post(base + path, json=ADD_SUB, timeout=60)
    theirs = requests.post(triton + path, json=ADD_SUB, timeout=60)
    assert answer(ours) == answer(theirs)
    if ours.status_code >= 400:
        assert_error_object(ours)
    else:
        assert ours.json()["outputs"][0]["data"] == [i + 3 for i in range(16)]


def test_unknown_model_over_the_handle_and_http_is_tritons_not_found(ingress) -> None:
    _, base = ingress
    response = requests.post(base + "/v2/models/nope/infer", json=ADD_SUB, timeout=60)
    assert response.status_code == 404
    assert assert_error_object(response) == "Request for unknown model: 'nope' is not found"


def _binary(name: str, size: int, **fields) -> dict:
    return {
        "name": name,
        "datatype": "INT32",
        "shape": [1, 16],
        "parameters": {"binary_data_size": size},
        **fields,
    }


def _json(name: str = "INPUT0", **fields) -> dict:
    return {"name": name, "datatype": "INT32", "shape": [1, 16], "data": list(range(16)), **fields}


def _req(*inputs: dict, **fields) -> dict:
    return {"inputs": list(inputs), **fields}


SIXTEEN = np.arange(16, dtype=np.int32).tobytes()
GOOD_SECOND = _json("INPUT1")

# Every decode_request refusal as raw HTTP: (id, header JSON or raw bytes, binary tail, header length).
BAD = [
    ("length-past-body", _req(_json(), GOOD_SECOND), b"", "999"),
    ("length-not-a-number", _req(_json(), GOOD_SECOND), b"", "abc"),
    ("length-negative", _req(_json(), GOOD_SECOND), b"", "-3"),
    ("not-json", b"{inputs: nope", b"", None),
    ("not-utf8", b'{"inputs": ["\xff"]}', b"", None),
    ("not-an-object", b"[1, 2]", b"", None),
    ("no-inputs", {"outputs": []}, b"", None),
    ("inputs-not-a-list", {"inputs": {"name": "INPUT0"}}, b"", None),
    ("entry-not-an-object", _req([1, 2], GOOD_SECOND), b"", None),
    ("entry-without-name", _req({"datatype": "INT32", "shape": [1, 16], "data": [1] * 16}), b"", None),
    ("name-not-a-string", _req(_json(name=5), GOOD_SECOND), b"", None),
    ("input-twice", _req(_json(), _json(), GOOD_SECOND), b"", None),
    ("unknown-datatype", _req(_json(datatype="INT128"), GOOD_SECOND), b"", None),
    ("datatype-not-a-string", _req(_json(datatype=3), GOOD_SECOND), b"", None),
    (
        "shape-missing",
        _req({"name": "INPUT0", "datatype": "INT32", "data": [1] * 16}, GOOD_SECOND),
        b"",
        None,
    ),
    ("shape-of-strings", _req(_json(shape=["1", "16"]), GOOD_SECOND), b"", None),
    ("shape-negative", _req(_json(shape=[-1, 16]), GOOD_SECOND), b"", None),
    ("no-data", _req({"name": "INPUT0", "datatype": "INT32", "shape": [1, 16]}, GOOD_SECOND), b"", None),
    ("data-not-an-array", _req(_json(data=7), GOOD_SECOND), b"", None),
    ("data-strings-for-int32", _req(_json(data=["a"] * 16), GOOD_SECOND), b"", None),
    ("data-digit-strings", _req(_json(data=["1"] * 16), GOOD_SECOND), b"", None),
    ("data-floats-for-int32", _req(_json(data=[1.5] * 16), GOOD_SECOND), b"", None),
    ("data-null", _req(_json(data=[None] * 16), GOOD_SECOND), b"", None),
    ("data-out-of-range", _req(_json(data=[2**40] * 16), GOOD_SECOND), b"", None),
    ("data-too-short", _req(_json(data=[1] * 15), GOOD_SECOND), b"", None),
    ("data-too-long", _req(_json(data=[1] * 17), GOOD_SECOND), b"", None),
    ("parameters-not-an-object", _req(_json(parameters=[1]), GOOD_SECOND), b"", None),
    ("binary-size-string", _req(_binary("INPUT0", "64"), GOOD_SECOND), SIXTEEN, "len"),
    ("binary-size-negative", _req(_binary("INPUT0", -64), GOOD_SECOND), SIXTEEN, "len"),
    ("binary-past-end", _req(_binary("INPUT0", 128), GOOD_SECOND), SIXTEEN, "len"),
    ("binary-size-not-shape", _req(_binary("INPUT0", 32), GOOD_SECOND), SIXTEEN, "len"),
    ("bytes-after-inputs", _req(_binary("INPUT0", 64), GOOD_SECOND), SIXTEEN + b"junk", "len"),
    ("request-parameters-not-an-object", _req(_json(), GOOD_SECOND, parameters="x"), b"", None),
    ("binary-output-not-bool", _req(_json(), GOOD_SECOND, parameters={"binary_data_output": 1}), b"", None),
    ("outputs-not-a-list", _req(_json(), GOOD_SECOND, outputs={"name": "OUTPUT0"}), b"", None),
    ("output-without-name", _req(_json(), GOOD_SECOND, outputs=[{}]), b"", None),
    (
        "output-binary-not-bool",
        _req(_json(), GOOD_SECOND, outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": "yes"}}]),
        b"",
        None,
    ),
    ("id-not-a-string", _req(_json(), GOOD_SECOND, id=5), b"", None),
    # Parser traps (deep nesting is in test_ingress_hostile.py: it would crash the reference Triton).
    (
        "int-5000-digits",
        b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": ['
        + b"9" * 5000
        + b"]}, "
        + json.dumps(GOOD_SECOND).encode()
        + b"]}",
        b"",
        None,
    ),
    (
        "nan",
        b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [NaN]}, '
        + json.dumps(GOOD_SECOND).encode()
        + b"]}",
        b"",
        None,
    ),
    (
        "duplicate-key",
        b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": '
        + json.dumps(list(range(16))).encode()
        + b', "data": []}, '
        + json.dumps(GOOD_SECOND).encode()
        + b"]}",
        b"",
        None,
    ),
    ("rank-100", _req(_json(shape=[1] * 100, data=[1]), GOOD_SECOND), b"", None),
    ("dim-2**70", _req(_json(shape=[0, 2**70], data=[]), GOOD_SECOND), b"", None),
    ("dims-past-int64", _req(_json(shape=[0, 2**62, 2**62], data=[]), GOOD_SECOND), b"", None),
    # Well-formed requests the model refuses.
    ("wrong-datatype-for-model", _req(_json(datatype="FP32", data=[0.5] * 16), GOOD_SECOND), b"", None),
    (
        "wrong-shape-for-model",
        _req(_json(shape=[1, 8], data=[1] * 8), _json("INPUT1", shape=[1, 8], data=[1] * 8)),
        b"",
        None,
    ),
    ("missing-input", _req(_json()), b"", None),
    ("unknown-output", _req(_json(), GOOD_SECOND, outputs=[{"name": "NOPE"}]), b"", None),
]

_BAD_BY_ID = {c[0]: c[1:] for c in BAD}


def _raw(header: dict | bytes, tail: bytes, length: str | None) -> tuple[bytes, dict[str, str]]:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    headers = {"Content-Type": "application/json"}
    if length == "len":
        headers["Inference-Header-Content-Length"] = str(len(head))
    elif length is not None:
        headers["Inference-Header-Content-Length"] = length
    return head + tail, headers


@pytest.mark.parametrize(("header", "tail", "length"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_every_bad_request_is_a_400_error_object(ingress, triton, header, tail, length) -> None:
    _, base = ingress
    data, headers = _raw(header, tail, length)
    ours = requests.post(base + "/v2/models/add_sub/infer", data=data, headers=headers, timeout=60)
    assert ours.status_code == 400, ours.content
    assert assert_error_object(ours)
    # Triton refuses it too: with 400, or with 500 where its JSON parser rejects it (we say 400 there);
    # the few it accepts are listed (it ignores a malformed input 'parameters', wraps out-of-range ints,
    # reads the first of two equal keys).
    theirs = requests.post(triton + "/v2/models/add_sub/infer", data=data, headers=headers, timeout=60)
    if any(
        header is _BAD_BY_ID[k][0] for k in ("data-out-of-range", "parameters-not-an-object", "duplicate-key")
    ):
        assert theirs.status_code == 200, theirs.content
    else:
        assert theirs.status_code in (400, 500), theirs.content


def _split_answer(response: requests.Response) -> tuple[int, object, bytes]:
    """Status, the JSON header and the binary tail of a (binary-extension) answer."""
    length = response.headers.get("inference-header-content-length")
    split = len(response.content) if length is None else int(length)
    return response.status_code, json.loads(response.content[:split]), response.content[split:]


@pytest.mark.parametrize("binary_output", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
def test_large_binary_requests_answer_exactly_as_triton(ingress, triton, binary_output, chunked) -> None:
    """4 MB of binary FP32 (the body written from Serve's chunks straight into a slot) and the answer.

    ``chunked`` sends the body without a Content-Length (the general path, body read whole).
    """
    _, base = ingress
    x = np.random.default_rng(18).random((1, 1024 * 1024), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_output)]
    body, length = httpclient.InferenceServerClient.generate_request_body([tensor], wanted, request_id="r18")
    headers = {"Inference-Header-Content-Length": str(length), "Content-Type": "application/octet-stream"}
    data = iter([body[: len(body) // 3], body[len(body) // 3 :]]) if chunked else body
    ours = requests.post(base + "/v2/models/identity/infer", data=data, headers=headers, timeout=120)
    theirs = requests.post(triton + "/v2/models/identity/infer", data=body, headers=headers, timeout=120)
    assert ours.status_code == 200, ours.content[:300]
    assert _split_answer(ours) == _split_answer(theirs)
    assert ours.headers["content-type"] == theirs.headers["content-type"]
    out = httpclient.InferenceServerClient.parse_response_body(
        ours.content,
        header_length=int(ours.headers.get("inference-header-content-length") or len(ours.content)),
    )
    assert np.array_equal(out.as_numpy("OUTPUT0"), x)


def test_binary_inputs_of_several_tensors_answer_exactly_as_triton(ingress, triton) -> None:
    """add_sub with one binary input and one JSON input, and with both binary."""
    _, base = ingress
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 7, dtype=np.int32)
    for binary_b in (False, True):
        t0 = httpclient.InferInput("INPUT0", [2, 16], "INT32")
        t0.set_data_from_numpy(a, binary_data=True)
        t1 = httpclient.InferInput("INPUT1", [2, 16], "INT32")
        t1.set_data_from_numpy(b, binary_data=binary_b)
        wanted = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
        ]
        body, length = httpclient.InferenceServerClient.generate_request_body([t0, t1], wanted)
        headers = {"Inference-Header-Content-Length": str(length)}
        ours = requests.post(base + "/v2/models/add_sub/infer", data=body, headers=headers, timeout=60)
        theirs = requests.post(triton + "/v2/models/add_sub/infer", data=body, headers=headers, timeout=60)
        assert ours.status_code == 200, ours.content[:300]
        assert _split_answer(ours) == _split_answer(theirs)


def test_a_binary_body_shorter_or_longer_than_its_tensors_is_tritons_400(ingress, triton) -> None:
    _, base = ingress
    x = np.ones((1, 64 * 1024), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    body, length = httpclient.InferenceServerClient.generate_request_body([tensor])
    headers = {"Inference-Header-Content-Length": str(length)}
    for data in (body[:-4], body + b"junk"):
        ours = requests.post(base + "/v2/models/identity/infer", data=data, headers=headers, timeout=60)
        theirs = requests.post(triton + "/v2/models/identity/infer", data=data, headers=headers, timeout=60)
        assert ours.status_code == theirs.status_code == 400, (ours.content, theirs.content)
        assert assert_error_object(ours)


def test_compressed_requests_are_inflated(ingress, triton) -> None:
    import gzip

    _, base = ingress
    data = gzip.compress(json.dumps(ADD_SUB).encode())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    for path in ("/v2/models/add_sub/infer", "/v2/models/add_sub/versions/1/infer"):
        ours = requests.post(base + path, data=data, headers=headers, timeout=60)
        theirs = requests.post(triton + path, data=data, headers=headers, timeout=60)
        assert ours.status_code == 200 and answer(ours) == answer(theirs)
    broken = requests.post(base + "/v2/models/add_sub/infer", data=b"not gzip", headers=headers, timeout=60)
    assert broken.status_code == 400 and "gzip" in assert_error_object(broken)


@pytest.mark.slow
def test_pool_timeout_is_503(ingress) -> None:
    """The only slot of ``sleep`` held past the pool's lease timeout: the next request answers 503."""
    _, base = ingress
    hold = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [SLEEP_HOLD_S]}]}
    quick = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}]}
    url = base + "/v2/models/sleep/infer"
    assert requests.post(url, json=quick, timeout=120).status_code == 200  # the pool exists
    held: list[requests.Response] = []
    holder = threading.Thread(target=lambda: held.append(requests.post(url, json=hold, timeout=180)))
    holder.start()
    try:
        time.sleep(2.0)  # let the holder take the slot (its request runs SLEEP_HOLD_S)
        asked = time.monotonic()
        refused = requests.post(url, json=quick, timeout=120)
        assert refused.status_code == 503, refused.content
        # Refused once it had waited out the lease timeout, not sooner.
        assert time.monotonic() - asked >= SLEEP_LEASE_TIMEOUT_S * 0.9, time.monotonic() - asked
        text = assert_error_object(refused)
        assert "no shared-memory slot of model 'sleep'" in text
        assert "in use by" not in text and "slots:" not in text, text  # the pool's state stays in the log
    finally:
        holder.join(timeout=180)
    assert held and held[0].status_code == 200 and held[0].json()["outputs"][0]["data"] == [SLEEP_HOLD_S]


def test_ready_follows_the_node_triton(ingress) -> None:
    """A stopped (SIGSTOP) Triton is not ready: health and model ready say 400 until it runs again."""
    handle, base = ingress
    pid = handle.whereami.remote().result()["triton_pid"]
    assert pid > 0
    stop_process(pid)
    try:
        for path in ("/v2/health/ready", "/v2/health/live", "/v2/models/add_sub/ready"):
            response = requests.get(base + path, timeout=60)
            assert response.status_code == 400, (path, response.content)
            assert "did not answer" in assert_error_object(response)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: requests.get(base + "/v2/health/ready", timeout=10).status_code == 200, 60)
    assert requests.get(base + "/v2/models/add_sub/ready", timeout=30).status_code == 200


def test_no_request_names_the_nodes_regions(ingress) -> None:
    """A pinned version goes to Triton as it is: shared-memory parameters are refused first.

    Otherwise a client could make the node's Triton read another request's
    inputs from a slot, or write its outputs into one.
    """
    import ray

    from ray_triton_shm.node import get_node_actor

    _, base = ingress
    assert requests.post(base + "/v2/models/add_sub/infer", json=ADD_SUB, timeout=60).status_code == 200
    info = ray.get(get_node_actor().info.remote())
    # A region the node registered (its name is its segment name), as if a client had learnt it.
    ours = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{info.actor_pid}_"))
    regions = [n for n in ours if "_node_" in n]
    assert regions, (info.actor_pid, ours)
    region = regions[0]
    for kind in ("inputs", "outputs"):
        named = {
            "name": "INPUT0" if kind == "inputs" else "OUTPUT0",
            "parameters": {"shared_memory_region": region, "shared_memory_byte_size": 64},
        }
        if kind == "inputs":
            request = {"inputs": [named, ADD_SUB["inputs"][1]]}
            request["inputs"][0].update(datatype="INT32", shape=[1, 16])
        else:
            request = {**ADD_SUB, "outputs": [named]}
        for path in ("/v2/models/add_sub/versions/1/infer", "/v2/models/add_sub/infer"):
            response = requests.post(base + path, json=request, timeout=60)
            assert response.status_code == 400, (path, response.content)
            assert "shared-memory parameters are not accepted" in assert_error_object(response)
    # The same request without them is served.
    assert (
        requests.post(base + "/v2/models/add_sub/versions/1/infer", json=ADD_SUB, timeout=60).status_code
        == 200
    )
