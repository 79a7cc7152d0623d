"""KServe v2 gRPC at the Serve ingress: an unmodified ``tritonclient.grpc`` client against
Serve's gRPC proxy, every answer compared with a real Triton's own gRPC endpoint
(the ``triton_server`` fixture, same model repository)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.helpers import free_port

from .conftest import CONFIG_FILE, frontdoor_on_free_ports, local_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    """(handle, gRPC address of the Serve app) from deployments/triton_shm.yaml (its grpc_options)."""
    from ray_triton_shm.serve import run_config_file

    spec = frontdoor_on_free_ports(yaml.safe_load(CONFIG_FILE.read_text()))
    assert spec["grpc_options"]["grpc_servicer_functions"], "the shipped config enables the gRPC ingress"
    port = free_port()
    spec["grpc_options"]["port"] = port
    spec["http_options"]["port"] = free_port()
    app = spec["applications"][0]
    app["args"]["quarantine_s"] = 1.0
    app["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1}]
    path = tmp_path_factory.mktemp("grpc") / "grpc.yaml"
    path.write_text(yaml.safe_dump(spec))
    with local_ray():
        handles = run_config_file(str(path))
        yield handles["triton"], f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def clients(ingress, triton_server):
    ours = grpcclient.InferenceServerClient(ingress[1])
    theirs = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def outcome(call, *args, **kwargs):
    """A call's answer, or its status code and message when it fails."""
    try:
        return "ok", call(*args, **kwargs)
    except InferenceServerException as e:
        return "error", e.status(), e.message()


def _inputs(x: np.ndarray, y: np.ndarray) -> list[grpcclient.InferInput]:
    a = grpcclient.InferInput("INPUT0", list(x.shape), "INT32")
    a.set_data_from_numpy(x)
    b = grpcclient.InferInput("INPUT1", list(y.shape), "INT32")
    b.set_data_from_numpy(y)
    return [a, b]


def _response(result) -> dict:
    """The answer's fields, outputs by name (data compared separately)."""
    response = result.get_response(as_json=True)
    response.pop("raw_output_contents", None)
    response["outputs"] = sorted(response["outputs"], key=lambda o: o["name"])
    return response


def test_health_answers_as_triton(clients) -> None:
    ours, theirs = clients
    assert outcome(ours.is_server_live) == outcome(theirs.is_server_live) == ("ok", True)
    assert outcome(ours.is_server_ready) == outcome(theirs.is_server_ready) == ("ok", True)
    for model in ("add_sub", "strings", "no_such_model"):
        assert outcome(ours.is_model_ready, model) == outcome(theirs.is_model_ready, model)
    assert outcome(ours.is_model_ready, "add_sub") == ("ok", True)
    assert outcome(ours.is_model_ready, "add_sub", "7") == outcome(theirs.is_model_ready, "add_sub", "7")


def test_metadata_and_config_answer_as_triton(clients) -> None:
    ours, theirs = clients
    mine = ours.get_server_metadata(as_json=True)
    reference = theirs.get_server_metadata(as_json=True)
    assert set(mine) == set(reference)
    assert mine["version"] == reference["version"]
    assert mine["name"] == reference["name"] == "triton"
    assert mine["extensions"] == ["model_configuration", "binary_tensor_data", "statistics"]
    for model in ("add_sub", "strings", "no_such_model"):
        assert outcome(ours.get_model_metadata, model, as_json=True) == outcome(
            theirs.get_model_metadata, model, as_json=True
        )
        assert outcome(ours.get_model_config, model, as_json=True) == outcome(
            theirs.get_model_config, model, as_json=True
        )
    assert outcome(ours.get_model_metadata, "add_sub", "7") == outcome(
        theirs.get_model_metadata, "add_sub", "7"
    )


def test_infer_answers_as_triton(clients) -> None:
    ours, theirs = clients
    x = np.arange(32, dtype=np.int32).reshape(2, 16)
    y = np.full((2, 16), 3, np.int32)
    for kwargs in ({}, {"request_id": "r-42"}, {"outputs": [grpcclient.InferRequestedOutput("OUTPUT1")]}):
        mine = ours.infer("add_sub", _inputs(x, y), **kwargs)
        reference = theirs.infer("add_sub", _inputs(x, y), **kwargs)
        assert _response(mine) == _response(reference)
        for output in _response(reference)["outputs"]:
            np.testing.assert_array_equal(mine.as_numpy(output["name"]), reference.as_numpy(output["name"]))
    np.testing.assert_array_equal(mine.as_numpy("OUTPUT1"), x - y)
    # A version asked for is Triton's to honour.
    assert _response(ours.infer("add_sub", _inputs(x, y), model_version="1")) == _response(
        theirs.infer("add_sub", _inputs(x, y), model_version="1")
    )


def test_bytes_tensors_answer_as_triton(clients) -> None:
    ours, theirs = clients
    text = np.array([[b"ray", b"triton", b""]], dtype=object)
    request = grpcclient.InferInput("TEXT", [1, 3], "BYTES")
    request.set_data_from_numpy(text)
    mine, reference = ours.infer("strings", [request]), theirs.infer("strings", [request])
    assert _response(mine) == _response(reference)
    np.testing.assert_array_equal(mine.as_numpy("UPPER"), reference.as_numpy("UPPER"))
    np.testing.assert_array_equal(mine.as_numpy("LENGTH"), [[3, 6, 0]])


def test_infer_goes_through_the_node_triton(ingress, clients) -> None:
    handle, _ = ingress
    ours, _ = clients
    where = handle.whereami.remote().result()
    x = np.full((1, 64), 5, np.float32)
    request = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    request.set_data_from_numpy(x)
    result = ours.infer("whoami", [request])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    assert set(result.as_numpy("SERVER_PID").ravel()) == {where["triton_pid"]}


def test_statistics_index_and_shared_memory_status_answer_as_triton(clients) -> None:
    ours, theirs = clients
    mine = ours.get_inference_statistics(as_json=True)["model_stats"]
    reference = theirs.get_inference_statistics(as_json=True)["model_stats"]
    assert sorted(m["name"] for m in mine) == sorted(m["name"] for m in reference)
    assert outcome(ours.get_inference_statistics, "no_such_model") == outcome(
        theirs.get_inference_statistics, "no_such_model"
    )
    assert outcome(ours.get_model_repository_index) == outcome(theirs.get_model_repository_index)
    # The caller registered no regions (the app's own never show), as a fresh Triton answers.
    assert outcome(ours.get_system_shared_memory_status) == outcome(theirs.get_system_shared_memory_status)
    assert outcome(ours.get_cuda_shared_memory_status) == outcome(theirs.get_cuda_shared_memory_status)


def test_what_the_ingress_refuses_says_why(clients) -> None:
    ours, theirs = clients
    refused = outcome(ours.register_system_shared_memory, "r", "/some_key", 64)
    assert refused[:2] == ("error", "StatusCode.UNIMPLEMENTED")
    assert "shared-memory registration is not supported by this endpoint" in refused[2]
    for call in (ours.load_model, ours.unload_model):  # no explicit model control: Triton's code
        mine, reference = outcome(call, "add_sub"), outcome(getattr(theirs, call.__name__), "add_sub")
        assert mine[:2] == reference[:2] == ("error", "StatusCode.UNAVAILABLE")
        assert "explicit model control" in mine[2]


def test_errors_have_tritons_codes(clients) -> None:
    ours, theirs = clients
    x = np.zeros((1, 16), np.int32)
    cases = [
        ("no_such_model", _inputs(x, x)),
        ("add_sub", _inputs(x, x)[:1]),  # an input missing
        ("add_sub", _inputs(np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32))),  # wrong shape
    ]
    wrong_type = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    wrong_type.set_data_from_numpy(np.zeros((1, 16), np.float32))
    cases.append(("add_sub", [wrong_type, _inputs(x, x)[1]]))
    for model, inputs in cases:
        mine = outcome(ours.infer, model, inputs)
        reference = outcome(theirs.infer, model, inputs)
        assert mine[0] == reference[0] == "error", (model, mine, reference)
        assert mine[1] == reference[1], (model, mine, reference)
        assert "rtshm_" not in mine[2] and "Traceback" not in mine[2] and "ray::" not in mine[2]
    unknown = outcome(ours.infer, "no_such_model", _inputs(x, x))
    assert unknown == outcome(theirs.infer, "no_such_model", _inputs(x, x)), "Triton's own message"


def test_the_application_header_selects_an_app(ingress, clients) -> None:
    from ray import serve

    from ray_triton_shm.serve import app

    ours, _ = clients
    spec = yaml.safe_load(CONFIG_FILE.read_text())
    args = dict(spec["applications"][0]["args"], quarantine_s=2.0)  # another node config: its own Triton
    args.pop("frontdoor")  # Serve's proxy is the one under test here
    other = serve.run(app(args), name="other", route_prefix="/other")
    try:
        other_pid = other.whereami.remote().result()["triton_pid"]
        first_pid = ingress[0].whereami.remote().result()["triton_pid"]
        assert other_pid != first_pid
        x = np.full((1, 8), 1, np.float32)
        request = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
        request.set_data_from_numpy(x)
        for name, pid in (("triton", first_pid), ("other", other_pid)):
            result = ours.infer("whoami", [request], headers={"application": name})
            assert set(result.as_numpy("SERVER_PID").ravel()) == {pid}
            assert ours.is_server_ready(headers={"application": name})
        # Two apps and no header, or an unknown app: Serve's proxy answers NOT_FOUND.
        assert outcome(ours.infer, "whoami", [request])[1] == "StatusCode.NOT_FOUND"
        missing = outcome(ours.infer, "whoami", [request], headers={"application": "nope"})
        assert missing[:2] == ("error", "StatusCode.NOT_FOUND")
    finally:
        serve.delete("other")
