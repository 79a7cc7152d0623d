"""The non-inference KServe v2 routes (HTTP and gRPC) without a server: what each one answers.

Forwarded routes go to a small HTTP server standing in for the node's Triton
(it records what it was sent and answers a fixed status); the answers of a
real Triton are compared in ``tests/integration/on_ray/test_conformance.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm import ServerConfig
from ray_triton_shm._private.serve.protocol import kserve_errors, kserve_routes
from ray_triton_shm._private.serve.protocol.grpc_messages import status_of
from ray_triton_shm._private.serve.protocol.kserve_grpc_routes import ROUTED, GrpcAnswerError, grpc_route
from ray_triton_shm._private.serve.protocol.kserve_routes import http_route, infer_route
from ray_triton_shm.errors import (
    ModelControlRefusedError,
    RefusedError,
    SettingsRefusedError,
    SharedMemoryRefusedError,
)


class FakeTriton:
    """Answers every request with ``status`` and ``body``; records (method, path, body)."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b'{"from": "triton"}'
        self.requests: list[tuple[str, str, bytes]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                fake.requests.append((self.command, self.path, self.rfile.read(length)))
                self.send_response(fake.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(fake.body)))
                self.end_headers()
                self.wfile.write(fake.body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Node:
    """A :class:`RouteNode` of the fake Triton."""

    def __init__(self, url: str, explicit: bool) -> None:
        self.info = SimpleNamespace(http_url=url, grpc_url="127.0.0.1:1", version="2.51.0")
        self.explicit_model_control = explicit
        self.max_request_bytes = 1 << 20
        self.changed: list[str] = []

    async def model_changed(self, model: str) -> None:
        self.changed.append(model)


@pytest.fixture
def triton() -> Iterator[FakeTriton]:
    fake = FakeTriton()
    yield fake
    fake.close()


def route(node: Node, method: str, path: str, body: bytes | None = None, **headers: str):
    return asyncio.run(http_route(node, method, path, "", headers, body))


def error(answer) -> str:
    return json.loads(answer.body)["error"]


def test_infer_route_is_only_unversioned_post_inference() -> None:
    assert infer_route("POST", "/v2/models/simple/infer") == "simple"
    assert infer_route("POST", "/v2/models/simple/versions/1/infer") is None
    assert infer_route("GET", "/v2/models/simple/infer") is None
    assert infer_route("POST", "/v2/models/simple/infer/") is None


@pytest.mark.parametrize("explicit", [False, True])
def test_server_metadata_is_tritons_name_and_version_with_the_extensions_served(explicit: bool) -> None:
    answer = route(Node("127.0.0.1:1", explicit), "GET", "/v2")
    body = json.loads(answer.body)
    assert answer.status == 200 and body["name"] == "triton" and body["version"] == "2.51.0"
    repository = ["model_repository", "model_repository(unload_dependents)"]
    assert body["extensions"] == [*(repository if explicit else []), *kserve_routes._BASE_EXTENSIONS]
    assert not {"system_shared_memory", "cuda_shared_memory", "logging", "trace"} & set(body["extensions"])
    grpc = asyncio.run(grpc_route(Node("127.0.0.1:1", explicit), "ServerMetadata", None, None))
    assert (grpc.name, grpc.version, list(grpc.extensions)) == ("triton", "2.51.0", body["extensions"])


@pytest.mark.parametrize("kind,word", [("systemsharedmemory", "system"), ("cudasharedmemory", "cuda")])
def test_shared_memory_is_the_callers_and_registration_refused(kind: str, word: str) -> None:
    node = Node("127.0.0.1:1", False)  # nothing is forwarded: an unreachable Triton is never asked
    status = route(node, "GET", f"/v2/{kind}/status")
    assert (status.status, status.body) == (200, b"[]")
    missing = route(node, "GET", f"/v2/{kind}/region/r1/status")
    assert missing.status == 404 and error(missing) == f"Unable to find {word} shared memory region: 'r1'"
    for path in (f"/v2/{kind}/unregister", f"/v2/{kind}/region/r1/unregister"):
        answer = route(node, "POST", path)
        assert (answer.status, answer.body) == (200, b"")
    for path in (f"/v2/{kind}/register", f"/v2/{kind}/region/r1/register"):
        refused = route(node, "POST", path, b'{"key": "/k", "byte_size": 64}')
        assert refused.status == 501
        assert error(refused).startswith(f"{word} shared-memory registration is not supported")
    assert route(node, "POST", f"/v2/{kind}/status").status == 405
    assert route(node, "GET", f"/v2/{kind}/region/r1/register").status == 405


def test_shared_memory_rpcs_answer_for_the_caller() -> None:
    node = Node("127.0.0.1:1", False)

    def call(method: str, request: Any) -> Any:
        return asyncio.run(grpc_route(node, method, request, None))

    assert call("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()) == (
        pb.SystemSharedMemoryStatusResponse()
    )
    with pytest.raises(GrpcAnswerError) as missing:
        call("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="r1"))
    assert (missing.value.code, missing.value.message) == (
        "NOT_FOUND",
        "Unable to find cuda shared memory region: 'r1'",
    )
    call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="r1"))
    with pytest.raises(SharedMemoryRefusedError) as refused:
        call("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(name="r", key="/k"))
    assert status_of(refused.value)[0] == "UNIMPLEMENTED" and "NodeClient" in status_of(refused.value)[1]


def test_model_control_is_refused_without_explicit_mode(triton: FakeTriton) -> None:
    node = Node(triton.url, False)
    refused = route(node, "POST", "/v2/repository/models/simple/load")
    assert refused.status == 503 and "cannot load model 'simple'" in error(refused)
    assert "model_control: explicit" in error(refused)
    with pytest.raises(ModelControlRefusedError) as grpc_refused:
        request = pb.RepositoryModelUnloadRequest(model_name="m")
        asyncio.run(grpc_route(node, "RepositoryModelUnload", request, None))
    assert status_of(grpc_refused.value)[0] == "UNAVAILABLE"
    assert triton.requests == [] and node.changed == []
    index = route(node, "POST", "/v2/repository/index", b"{}")  # the index is Triton's in any mode
    assert index.status == 200 and triton.requests == [("POST", "/v2/repository/index", b"{}")]


def test_model_control_is_forwarded_and_the_node_told_with_explicit_mode(triton: FakeTriton) -> None:
    node = Node(triton.url, True)
    triton.body = b""
    body = b'{"parameters": {"config": "{}"}}'
    assert route(node, "POST", "/v2/repository/models/simple/load", body).status == 200
    assert triton.requests[-1] == ("POST", "/v2/repository/models/simple/load", body)
    assert node.changed == ["simple"]
    triton.status, triton.body = 500, b'{"error": "failed to load \'nope\'"}'
    failed = route(node, "POST", "/v2/repository/models/nope/load")
    assert failed.status == 500 and error(failed) == "failed to load 'nope'"
    assert node.changed == ["simple"], "a failed load changes nothing"


def test_model_files_in_a_load_are_refused(triton: FakeTriton) -> None:
    node = Node(triton.url, True)
    body = b'{"parameters": {"config": "{}", "file:1/model.py": "YQ=="}}'
    refused = route(node, "POST", "/v2/repository/models/simple/load", body)
    assert refused.status == 501 and "does not accept model files" in error(refused)
    request = pb.RepositoryModelLoadRequest(model_name="simple")
    request.parameters["file:1/model.py"].bytes_param = b"a"
    with pytest.raises(ModelControlRefusedError) as grpc_refused:
        asyncio.run(grpc_route(node, "RepositoryModelLoad", request, None))
    assert status_of(grpc_refused.value)[0] == "UNIMPLEMENTED"
    assert triton.requests == [] and node.changed == []


def test_settings_are_read_and_never_changed(triton: FakeTriton) -> None:
    node = Node(triton.url, False)
    for method, path, body in (
        ("GET", "/v2/logging", None),
        ("POST", "/v2/trace/setting", b"{}"),
        ("GET", "/v2/models/simple/trace/setting", None),
        ("POST", "/v2/logging", b"not json"),  # Triton says what is wrong with it
    ):
        assert route(node, method, path, body).status == 200
    assert len(triton.requests) == 4
    changes = (("/v2/logging", b'{"log_verbose_level": 1}'), ("/v2/trace/setting", b'{"trace_rate": "5"}'))
    for path, body in changes:
        refused = route(node, "POST", path, body)
        assert refused.status == 501 and "settings is not supported" in error(refused)
    assert len(triton.requests) == 4
    request = pb.LogSettingsRequest()
    request.settings["log_verbose_level"].uint32_param = 1
    with pytest.raises(SettingsRefusedError):
        asyncio.run(grpc_route(node, "LogSettings", request, None))


def test_forwarded_routes_reach_triton_as_sent(triton: FakeTriton) -> None:
    node = Node(triton.url, False)
    for path in ("/v2/models/stats", "/v2/models/my model/versions/2/stats", "/v2/models/m/config"):
        assert route(node, "GET", path).body == b'{"from": "triton"}'
    assert [r[1] for r in triton.requests] == [
        "/v2/models/stats",
        "/v2/models/my%20model/versions/2/stats",
        "/v2/models/m/config",
    ]
    triton.status = 400
    triton.body = b'{"error": "no region rtshm_1_2_slots_abc"}'
    assert b"rtshm_1_2_slots_abc" not in route(node, "GET", "/v2/models/stats").body


def test_versioned_inference_with_shared_memory_parameters_is_refused(triton: FakeTriton) -> None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "parameters": {"shared_memory_region": "r"}, "shape": [1]}]}
    ).encode()
    refused = route(Node(triton.url, False), "POST", "/v2/models/m/versions/1/infer", body)
    assert refused.status == 400 and "shared-memory parameters" in error(refused)
    assert triton.requests == []


def test_unknown_paths_and_methods_are_tritons_404_and_405() -> None:
    node = Node("127.0.0.1:1", False)
    for method, path in (("GET", "/v2/nothing"), ("GET", "/v2/models"), ("GET", "/v2/models/m/stats/")):
        answer = route(node, method, path)
        assert (answer.status, error(answer)) == (404, "Not Found")
    for method, path in (("POST", "/v2"), ("GET", "/v2/models/m/infer"), ("GET", "/v2/repository/index")):
        answer = route(node, method, path)
        assert (answer.status, error(answer)) == (405, "Method Not Allowed")


def test_an_unreachable_triton_is_503_and_not_ready() -> None:
    node = Node("127.0.0.1:1", False)
    assert route(node, "GET", "/v2/models/stats").status == 503
    assert route(node, "GET", "/v2/health/ready").status == 400

    async def unreachable(method: str, request: Any, response_cls: Any, timeout: float) -> Any:
        raise GrpcAnswerError("UNAVAILABLE", "failed to connect")

    ready = asyncio.run(grpc_route(node, "ServerReady", pb.ServerReadyRequest(), unreachable))
    assert ready == pb.ServerReadyResponse(ready=False)
    with pytest.raises(GrpcAnswerError):
        asyncio.run(grpc_route(node, "ModelStatistics", pb.ModelStatisticsRequest(), unreachable))


def test_every_rpc_but_inference_is_routed_and_refusals_have_a_message() -> None:
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert set(ROUTED) == names - {"ModelInfer"}
    with pytest.raises(RefusedError) as refused:
        asyncio.run(grpc_route(Node("127.0.0.1:1", False), "ModelStreamInfer", None, None))
    assert status_of(refused.value) == ("UNIMPLEMENTED", refused.value.message) and refused.value.message


def test_refusals_map_to_tritons_codes() -> None:
    assert kserve_errors.http_status(SharedMemoryRefusedError("no")) == 501
    assert kserve_errors.http_status(ModelControlRefusedError("no", "UNAVAILABLE")) == 503
    assert kserve_errors.error_message(SettingsRefusedError("why")) == "why"


@pytest.mark.parametrize(
    "fields,explicit",
    [
        ({}, False),
        ({"model_control": "explicit"}, True),
        ({"load_models": ("a",)}, True),
        ({"extra_args": ("--model-control-mode=explicit",)}, True),
        ({"extra_args": ("--model-control-mode", "poll")}, False),
        ({"model_control": "explicit", "extra_args": ("--model-control-mode=none",)}, False),
    ],
)
def test_explicit_model_control_follows_the_server_flags(fields: dict, explicit: bool) -> None:
    assert ServerConfig(model_repository="/models", **fields).explicit_model_control is explicit
