"""The Serve app's KServe v2 ingress answers as Triton's own endpoint does, checked two ways.

* Routes: every non-inference route and RPC (server metadata, statistics,
  shared-memory status and registration, repository index and control, log
  and trace settings, unknown paths and methods) asked of the app and of a
  real Triton (the app's node Triton, or a fresh one on the same repository),
  answers compared: same status code and body, except where the ingress
  refuses (then a typed refusal with its message).
* Programs: Triton's own client programs (the client repository's
  ``src/python/examples``), run unchanged as subprocesses against the app's
  client ports (the :func:`front_door` fixture), models of the names they load
  in ``tests/models/conformance``. They are found in
  ``../shared/conformance/tritonclient_examples`` beside the repository, or in
  the directory named by ``RAY_TRITON_SHM_CONFORMANCE_DIR``; each must exit 0.
  More programs in ``RAY_TRITON_SHM_CONFORMANCE_EXTRA`` (model control, shared
  memory, ...) must end as they end against a Triton of the same repository,
  except that a program that registers shared memory must fail on the
  ingress's refusal. Absent directories skip, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from .conformance_programs import (
    REFUSALS,
    SHM_REFUSAL,
    FrontDoor,
    extra_dir,
    meets_a_refusal,
    program_dir,
    program_params,
    run_program,
    shown,
)
from .conftest import CONFIG_FILE, REPO, free_port, teardown_ray

MODELS = REPO / "tests" / "models" / "conformance"
# Pools of the models the programs call: BYTES elements up to 64 bytes, simple_identity rows up to 64.
POOLS = {
    "simple": {"slots": 4},
    "simple_int8": {"slots": 2},
    "simple_string": {"slots": 2, "max_element_bytes": 64},
    "simple_identity": {"slots": 2, "max_element_bytes": 64, "max_shapes": {"INPUT0": [64], "OUTPUT0": [64]}},
}


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's functions by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def conformance_app(tmp_path_factory):
    """(handle, the app's front door, Serve's proxies): deployments/triton_shm.yaml on the
    conformance models, explicit model control."""
    import ray

    from ray_triton_shm.serve import run_config_file

    spec = yaml.safe_load(CONFIG_FILE.read_text())
    http_port, grpc_port = free_port(), free_port()
    spec["http_options"]["port"] = http_port
    spec["grpc_options"]["port"] = grpc_port
    door_ports = free_port(), free_port()
    app = spec["applications"][0]
    app["args"] = {
        "frontdoor": {"host": "127.0.0.1", "http_port": door_ports[0], "grpc_port": door_ports[1]},
        "model_repository": str(MODELS),
        "server": {"model_control": "explicit"},
        "quarantine_s": 1.0,
        "pools": POOLS,
    }
    app["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1}]
    path = tmp_path_factory.mktemp("conformance") / "conformance.yaml"
    path.write_text(yaml.safe_dump(spec))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handles = run_config_file(str(path))
        door = FrontDoor(f"127.0.0.1:{door_ports[0]}", f"127.0.0.1:{door_ports[1]}")
        proxies = FrontDoor(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
        _wait_ready(door)
        _wait_ready(proxies)
        yield handles["triton"], door, proxies
    finally:
        teardown_ray()


@pytest.fixture(scope="module")
def front_door(conformance_app) -> FrontDoor:
    """The ports the route checks are sent to: the app's documented client ports (its front door)."""
    return conformance_app[1]


@pytest.fixture(scope="module", params=["frontdoor", "serve-proxies"])
def client_ports(request, conformance_app) -> FrontDoor:
    """The ports the programs run against: the front door, then Serve's own proxies."""
    return conformance_app[1] if request.param == "frontdoor" else conformance_app[2]


@pytest.fixture(scope="module")
def node_triton(conformance_app) -> tuple[str, str]:
    """(HTTP, gRPC) address of the app's node Triton."""
    where = conformance_app[0].whereami.remote().result()
    return where["http_url"], where["grpc_url"]


@pytest.fixture(scope="module")
def reference():
    """A fresh Triton on the same models (explicit model control), for what a client of Triton gets."""
    from ray_triton_shm import ServerConfig, TritonServer

    with TritonServer(ServerConfig(model_repository=str(MODELS), model_control="explicit")) as server:
        yield server


def _wait_ready(door: FrontDoor, timeout_s: float = 180.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(f"http://{door.http}/v2/health/ready", timeout=10).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app at {door.http} did not become ready")
        time.sleep(1.0)


def ask(base: str, method: str, path: str, body: bytes | None = None) -> tuple[int, object]:
    """Status and body (JSON when it parses, else the bytes) of one HTTP request to ``base``."""
    answer = requests.request(method, f"http://{base}{path}", data=body, timeout=120)
    try:
        return answer.status_code, answer.json()
    except ValueError:
        return answer.status_code, answer.content


def outcome(call, *args, as_json: bool = True, **kwargs):
    """A gRPC call's answer (as JSON unless ``as_json`` is false), or its status code and message."""
    try:
        return "ok", call(*args, **({"as_json": True} if as_json else {}), **kwargs)
    except InferenceServerException as e:
        return "error", e.status(), e.message()


def _regions_in_triton(actor_self) -> list[str]:
    """Run inside the node actor: the regions its Triton has registered (it holds the shm key)."""
    status = actor_self._grpc.get_system_shared_memory_status(
        headers=actor_self._server.shm_api_headers, as_json=True
    )
    return sorted(region["name"] for region in status.get("regions", {}).values())


def node_regions() -> list[str]:
    """The regions registered in the app's node Triton (its shared-memory API needs the node's key)."""
    import ray

    from ray_triton_shm._private.node.model_control import node_actors

    ((_, actor),) = node_actors()
    return ray.get(actor.__ray_call__.remote(_regions_in_triton))


def simple_inputs(x: np.ndarray) -> list[grpcclient.InferInput]:
    """INPUT0 and INPUT1 of ``simple``, both ``x``."""
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, list(x.shape), "INT32")
        tensor.set_data_from_numpy(x)
        inputs.append(tensor)
    return inputs


@pytest.fixture(scope="module")
def grpc_clients(front_door, node_triton, reference):
    """gRPC clients of (the app, its node Triton, the reference Triton)."""
    clients = [
        grpcclient.InferenceServerClient(url) for url in (front_door.grpc, node_triton[1], reference.grpc_url)
    ]
    yield clients
    for client in clients:
        client.close()


# -- routes -------------------------------------------------------------------------------------


def test_server_metadata_is_tritons_with_the_extensions_served(front_door, reference, grpc_clients) -> None:
    served = ["model_repository", "model_repository(unload_dependents)", "model_configuration",
              "binary_tensor_data", "statistics"]  # fmt: skip
    code, ours = ask(front_door.http, "GET", "/v2")
    _, theirs = ask(reference.http_url, "GET", "/v2")
    assert code == 200 and ours == {"name": "triton", "version": theirs["version"], "extensions": served}
    assert set(served) <= set(theirs["extensions"])
    mine, _, triton = (outcome(client.get_server_metadata) for client in grpc_clients)
    assert mine == ("ok", {"name": "triton", "version": triton[1]["version"], "extensions": served})


def test_statistics_are_the_node_tritons(front_door, node_triton, grpc_clients) -> None:
    for path in (
        "/v2/models/stats",
        "/v2/models/simple/stats",
        "/v2/models/simple/versions/1/stats",
        "/v2/models/simple_versions/versions/2/stats",
        "/v2/models/simple/versions/7/stats",  # Triton's 400
        "/v2/models/no_such_model/stats",
    ):
        assert ask(front_door.http, "GET", path) == ask(node_triton[0], "GET", path), path
    ours, node, _ = grpc_clients
    for kwargs in ({}, {"model_name": "simple"}, {"model_name": "simple", "model_version": "7"},
                   {"model_name": "no_such_model"}):  # fmt: skip
        assert outcome(ours.get_inference_statistics, **kwargs) == outcome(
            node.get_inference_statistics, **kwargs
        ), kwargs


def test_shared_memory_status_is_the_callers(front_door, node_triton, reference, grpc_clients) -> None:
    """No regions for the caller, as a fresh Triton answers, though the node's Triton has the app's."""
    ours, _, theirs = grpc_clients
    # Through the app's slots: the node's Triton has regions now.
    ours.infer("simple", simple_inputs(np.ones((1, 16), np.int32)))
    assert node_regions(), "the app's slot regions are registered in its node's Triton"
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        for method, path in (
            ("GET", f"/v2/{kind}/status"),
            ("GET", f"/v2/{kind}/region/some_region/status"),
            ("POST", f"/v2/{kind}/unregister"),
            ("POST", f"/v2/{kind}/region/some_region/unregister"),
            ("POST", f"/v2/{kind}/status"),  # Triton's 405
            ("GET", f"/v2/{kind}/region/some_region/register"),
        ):
            assert ask(front_door.http, method, path) == ask(reference.http_url, method, path), path
    for call in ("get_system_shared_memory_status", "get_cuda_shared_memory_status"):
        for kwargs in ({}, {"region_name": "some_region"}):
            assert outcome(getattr(ours, call), **kwargs) == outcome(getattr(theirs, call), **kwargs)
    for call in ("unregister_system_shared_memory", "unregister_cuda_shared_memory"):
        for args in ((), ("some_region",)):
            getattr(ours, call)(*args)  # no error, as Triton
    assert node_regions(), "the app's regions stay"


def test_shared_memory_registration_is_refused_with_a_reason(front_door, node_triton, grpc_clients) -> None:
    ours, _, _ = grpc_clients
    before = node_regions()
    body = b'{"key": "/some_key", "offset": 0, "byte_size": 64}'
    for kind in ("system", "cuda"):
        code, answer = ask(front_door.http, "POST", f"/v2/{kind}sharedmemory/region/r/register", body)
        assert code == 501 and f"{kind} {SHM_REFUSAL}" in answer["error"], answer
        assert "NodeClient" in answer["error"] and "binary tensor data" in answer["error"]
    with pytest.raises(InferenceServerException) as refused:
        ours.register_system_shared_memory("r", "/some_key", 64)
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED" and SHM_REFUSAL in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        ours.register_cuda_shared_memory("r", b"\0" * 64, 0, 64)
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED" and SHM_REFUSAL in refused.value.message()
    assert node_regions() == before


def test_repository_index_load_and_unload_are_tritons(
    front_door, node_triton, reference, grpc_clients
) -> None:
    for body in (None, b'{"ready": true}', b"not json"):
        assert ask(front_door.http, "POST", "/v2/repository/index", body) == ask(
            node_triton[0], "POST", "/v2/repository/index", body
        )
    for method, path, body in (
        ("POST", "/v2/repository/models/no_such_model/load", None),  # Triton's 500
        ("POST", "/v2/repository/models/no_such_model/unload", None),
        ("POST", "/v2/repository/models/simple/load", b"not json"),
        ("POST", "/v2/repository/models/simple_nobatch/load", None),  # a reload
        ("GET", "/v2/repository/models/simple/load", None),  # 405
        ("GET", "/v2/repository/index", None),
    ):
        assert ask(front_door.http, method, path, body) == ask(reference.http_url, method, path, body), path
    ours, node, theirs = grpc_clients
    assert outcome(ours.get_model_repository_index) == outcome(node.get_model_repository_index)
    for call in ("load_model", "unload_model"):
        mine = outcome(getattr(ours, call), "no_such_model", as_json=False)
        assert mine == outcome(getattr(theirs, call), "no_such_model", as_json=False), call


def test_a_reload_with_another_config_is_served_on_its_new_layout(front_door, grpc_clients) -> None:
    ours, node, _ = grpc_clients
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    try:
        ours.load_model("simple", config='{"max_batch_size": 16}')
        assert node.get_model_config("simple", as_json=True)["config"]["max_batch_size"] == 16
        # A batch larger than the old layout's 8 rows.
        result = ours.infer("simple", simple_inputs(np.ones((12, 16), np.int32)))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((12, 16), 2))
        ours.unload_model("simple")
        assert not ours.is_model_ready("simple")
    finally:
        ours.load_model("simple")
    np.testing.assert_array_equal(ours.infer("simple", simple_inputs(x)).as_numpy("OUTPUT0"), 2 * x)


def test_model_files_sent_in_a_load_are_refused(front_door, conformance_app, grpc_clients) -> None:
    """Files would be written to and run on the node; this one (a path component over NAME_MAX)
    makes Triton 2.51 itself abort."""
    ours, _, _ = grpc_clients
    pid = conformance_app[0].whereami.remote().result()["triton_pid"]
    files = {"file:" + "A" * 256: b"a"}
    refused = outcome(ours.load_model, "simple", config="{}", files=files, as_json=False)
    assert refused[:2] == ("error", "StatusCode.UNIMPLEMENTED") and "model files" in refused[2]
    body = b'{"parameters": {"config": "{}", "file:1/model.py": "YQ=="}}'
    code, answer = ask(front_door.http, "POST", "/v2/repository/models/simple/load", body)
    assert code == 501 and "does not accept model files" in answer["error"]
    assert conformance_app[0].whereami.remote().result()["triton_pid"] == pid
    assert ours.is_model_ready("simple")


def test_log_and_trace_settings_are_read_and_never_changed(front_door, node_triton, grpc_clients) -> None:
    for method, path, body in (
        ("GET", "/v2/logging", None),
        ("POST", "/v2/logging", b"{}"),
        ("GET", "/v2/trace/setting", None),
        ("POST", "/v2/trace/setting", b"{}"),
        ("GET", "/v2/models/simple/trace/setting", None),
        ("GET", "/v2/models/no_such_model/trace/setting", None),
        ("PUT", "/v2/logging", None),
    ):
        assert ask(front_door.http, method, path, body) == ask(node_triton[0], method, path, body), path
    for path, body in (
        ("/v2/logging", b'{"log_verbose_level": 1}'),
        ("/v2/trace/setting", b'{"trace_rate": "5"}'),
        ("/v2/models/simple/trace/setting", b'{"trace_level": ["TIMESTAMPS"]}'),
    ):
        code, answer = ask(front_door.http, "POST", path, body)
        assert code == 501 and "settings is not supported by this endpoint" in answer["error"], answer
    assert ask(node_triton[0], "GET", "/v2/logging")[1]["log_verbose_level"] == 0
    ours, node, _ = grpc_clients
    assert outcome(ours.get_log_settings) == outcome(node.get_log_settings)
    assert outcome(ours.get_trace_settings) == outcome(node.get_trace_settings)
    assert outcome(ours.get_trace_settings, model_name="simple") == outcome(
        node.get_trace_settings, model_name="simple"
    )
    for call, kwargs in (
        (ours.update_log_settings, {"settings": {"log_verbose_level": 1}}),
        (ours.update_trace_settings, {"settings": {"trace_rate": "5"}}),
    ):
        refused = outcome(call, **kwargs)
        assert refused[:2] == ("error", "StatusCode.UNIMPLEMENTED") and "not supported" in refused[2]


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/v2/nothing", None),
        ("GET", "/v2/models", None),
        ("GET", "/v2/health", None),
        ("GET", "/metrics", None),
        ("POST", "/v2", b""),
        ("DELETE", "/v2", None),
        ("POST", "/v2/health/live", b""),
        ("PUT", "/v2/models/simple/stats", b""),
        ("GET", "/v2/models/simple/infer", None),
        ("POST", "/v2/models/simple/config", b""),
        ("GET", "/v2/models/simple/stats/", None),
        ("GET", "/v2/models/simple/versions/x/stats", None),
        ("GET", "/v2/models/simple/generate", None),
        ("POST", "/v2/models/simple/generate", b"{}"),
        ("POST", "/v2/models/simple/generate_stream", b"{}"),
        ("POST", "/v2/models/no_such_model/generate", b"{}"),
        ("GET", "/v2/systemsharedmemory/region/r", None),
    ],
)
def test_other_paths_and_methods_answer_as_triton(front_door, reference, method, path, body) -> None:
    assert ask(front_door.http, method, path, body) == ask(reference.http_url, method, path, body)


def test_a_models_own_error_reaches_the_client_as_tritons(front_door, reference, grpc_clients) -> None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}]}
    ).encode()
    for path in ("/v2/models/simple_error/infer", "/v2/models/simple_error/versions/1/infer"):
        assert ask(front_door.http, "POST", path, body) == ask(reference.http_url, "POST", path, body)
    ours, _, theirs = grpc_clients
    x = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    x.set_data_from_numpy(np.zeros((1, 16), np.int32))
    mine = outcome(ours.infer, "simple_error", [x], as_json=False)
    assert mine == outcome(theirs.infer, "simple_error", [x], as_json=False)
    assert mine[0] == "error" and "simple_error fails every request" in mine[2]


def test_stream_inference_is_refused_with_a_message(front_door) -> None:
    import queue

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(front_door.grpc)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error))
        try:
            client.async_stream_infer("simple", simple_inputs(np.ones((1, 16), np.int32)))
        except InferenceServerException as e:
            # The refusal can end the stream before the request is queued: tritonclient then says
            # so here, and hands the server's error to the callback all the same.
            assert "no longer in valid state" in e.message(), e
        error = answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and "ModelStreamInfer is not supported" in error.message(), error


# -- Triton's own programs ----------------------------------------------------------------------


@pytest.mark.parametrize("program", program_params(program_dir(), "tritonclient example programs"))
def test_tritons_example_program_passes(program: Path, client_ports: FrontDoor, tmp_path: Path) -> None:
    result = run_program(program, client_ports.url_for(program), tmp_path)
    assert result.returncode == 0, f"{program.name} against {client_ports.url_for(program)}: {shown(result)}"


def _restore(server, urls: list[str]) -> None:
    """``simple`` served as the repository has it (model-control programs unload or reconfigure it),
    and the reference Triton running (Triton 2.51 aborts on a model file path longer than NAME_MAX)."""
    if not server.is_alive():
        server.restart(kill=True)
    for url in [*urls, server.grpc_url]:
        with grpcclient.InferenceServerClient(url) as client:
            client.load_model("simple")


@pytest.mark.parametrize("program", program_params(extra_dir(), "extra programs"))
def test_extra_program_ends_as_against_triton(
    program: Path, front_door: FrontDoor, reference, tmp_path: Path
) -> None:
    """As against a Triton of the same repository, but failing on the ingress's refusal where it meets one."""
    try:
        url = reference.grpc_url if "grpc" in program.name else reference.http_url
        theirs = run_program(program, url, tmp_path)
        if not reference.is_alive():
            theirs.stderr += "\n[the reference Triton died during this program]"
        ours = run_program(program, front_door.url_for(program), tmp_path)
    finally:
        _restore(reference, [front_door.grpc])
    both = f"ours: {shown(ours)}\nTriton's own: {shown(theirs)}"
    print(f"\n=== {program.name}: ours {ours.returncode}, Triton {theirs.returncode}\n{both[-1500:]}")
    refused = any(text in ours.stdout + ours.stderr for text in REFUSALS)
    if meets_a_refusal(program) and theirs.returncode == 0:
        assert ours.returncode != 0 and refused, both
    else:
        assert ours.returncode == theirs.returncode, both
