"""The HTTP request/response handling of shm requests, without a server."""

from __future__ import annotations

import json
import pickle

import pytest

from ray_triton_shm._private.triton.call_errors import region_unknown
from ray_triton_shm._private.triton.http_infer import (
    HttpShmSender,
    ShmInput,
    ShmOutput,
    _MalformedAnswer,
    _parse_head,
    cached_request,
    error_from_response,
    output_shapes,
    request_body,
)
from ray_triton_shm.errors import OutputTooLargeError, PoolClosedError, TritonCallError, UnavailableError

KEY = "rtshm_123_456_pool_0123456789abcdef0123456789abcdef"


def test_request_body_is_kserve_v2_with_shared_memory_parameters() -> None:
    body = json.loads(
        request_body(
            [
                ShmInput("INPUT0", (2, 16), "INT32", "region", 128, 64),
                ShmInput("INPUT1", (2, 16), "INT32", "region", 128, 192),
            ],
            [ShmOutput("OUTPUT0", "region", 128, 320)],
        )
    )
    assert body == {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [2, 16],
                "datatype": "INT32",
                "parameters": {
                    "shared_memory_region": "region",
                    "shared_memory_byte_size": 128,
                    "shared_memory_offset": 64,
                },
            },
            {
                "name": "INPUT1",
                "shape": [2, 16],
                "datatype": "INT32",
                "parameters": {
                    "shared_memory_region": "region",
                    "shared_memory_byte_size": 128,
                    "shared_memory_offset": 192,
                },
            },
        ],
        "outputs": [
            {
                "name": "OUTPUT0",
                "parameters": {
                    "shared_memory_region": "region",
                    "shared_memory_byte_size": 128,
                    "shared_memory_offset": 320,
                },
            }
        ],
    }


def test_output_shapes_reads_the_requested_outputs() -> None:
    answer = json.dumps(
        {
            "model_name": "m",
            "outputs": [
                {"name": "B", "datatype": "FP32", "shape": [1, 3]},
                {"name": "A", "datatype": "FP32", "shape": [2, 5, 7]},
            ],
        }
    ).encode()
    assert output_shapes(answer, "m", ["A", "B"]) == {"A": (2, 5, 7), "B": (1, 3)}
    assert output_shapes(answer, "m", ["B"]) == {"B": (1, 3)}


@pytest.mark.parametrize("answer", [b"", b"not json", b'{"outputs": 3}', b'{"outputs": [{"name": "A"}]}'])
def test_unreadable_answers_raise_triton_call_error(answer: bytes) -> None:
    with pytest.raises(TritonCallError, match="unreadable response") as info:
        output_shapes(answer, "m", ["A"])
    assert info.value.model == "m"


def test_a_missing_output_raises() -> None:
    answer = json.dumps({"outputs": [{"name": "A", "shape": [1]}]}).encode()
    with pytest.raises(TritonCallError, match="no output 'B'"):
        output_shapes(answer, "m", ["A", "B"])


def _error(code: int, message: str) -> TritonCallError:
    return error_from_response(code, json.dumps({"error": message}).encode(), "m")


def test_unknown_region_is_not_found_and_the_key_is_redacted() -> None:
    err = _error(404, f"Unable to find shared memory region: '{KEY}'")
    assert type(err) is TritonCallError and err.status == "NOT_FOUND" and err.model == "m"
    assert region_unknown(err)
    assert KEY not in str(err) and "<shm>" in str(err)


def test_statuses_follow_tritons_http_codes() -> None:
    assert _error(400, "bad").status == "INVALID_ARGUMENT"
    assert _error(500, "model failed").status == "INTERNAL"
    assert isinstance(_error(503, "not ready"), UnavailableError)
    assert not isinstance(_error(500, "x"), UnavailableError)
    assert _error(418, "teapot").status == "UNKNOWN"
    assert not region_unknown(_error(404, "Request for unknown model: 'x' is not found"))


def test_output_too_large_is_typed_like_over_grpc() -> None:
    err = _error(
        400,
        "shared memory size specified with the request for output 'OUTPUT0' "
        "should be at least 400 bytes to hold the results",
    )
    assert isinstance(err, OutputTooLargeError) and "max_shapes" in str(err)


def test_a_non_json_error_body_is_kept_as_text() -> None:
    err = error_from_response(502, b"<html>bad gateway</html>", "m")
    assert "bad gateway" in str(err) and err.status == "UNKNOWN"
    assert "HTTP 500" in str(error_from_response(500, b"", "m"))


def test_errors_survive_pickling_across_processes() -> None:
    err = _error(404, "Unable to find shared memory region: 'r'")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.status, back.model, str(back)) == (type(err), err.status, err.model, str(err))


def test_a_closed_sender_refuses_and_close_is_idempotent() -> None:
    sender = HttpShmSender("127.0.0.1:9", timeout_s=1.0)
    sender.close()
    sender.close()
    with pytest.raises(PoolClosedError):
        sender.infer("m", [], [])


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 244", (200, 244, True)),
        (b"HTTP/1.1 404 Not Found\r\ncontent-length: 60\r\nConnection: close", (404, 60, False)),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2", (200, 2, False)),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive", (200, 2, True)),
    ],
)
def test_answer_heads_are_parsed(head: bytes, expected: tuple[int, int, bool]) -> None:
    assert _parse_head(head) == expected


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json",
        b"SSH-2.0-OpenSSH_9.6",
        b"HTTP/1.1 abc OK\r\nContent-Length: 1",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten",
    ],
)
def test_answers_triton_never_sends_are_refused(head: bytes) -> None:
    with pytest.raises(_MalformedAnswer):
        _parse_head(head)


def test_an_output_of_another_datatype_than_the_layouts_is_refused() -> None:
    answer = json.dumps({"outputs": [{"name": "A", "datatype": "INT32", "shape": [4]}]}).encode()
    expected = [ShmOutput("A", "region", 16, 0, "FP32")]
    with pytest.raises(TritonCallError) as info:
        output_shapes(answer, "m", ["A"], expected)
    assert info.value.status == "INVALID_ARGUMENT" and "INT32" in str(info.value)
    assert output_shapes(answer, "m", ["A"], [ShmOutput("A", "region", 16, 0, "INT32")]) == {"A": (4,)}
    assert output_shapes(answer, "m", ["A"], [ShmOutput("A", "region", 16, 0)]) == {"A": (4,)}


def test_a_repeated_request_is_encoded_once_and_a_different_one_anew() -> None:
    inputs = (ShmInput("IN", (1, 4), "FP32", "region", 16, 0),)
    outputs = (ShmOutput("OUT", "region", 16, 16, "FP32"),)
    path, body = cached_request("my model", inputs, outputs)
    assert path == "/v2/models/my%20model/infer" and body == request_body(inputs, outputs)
    again = cached_request("my model", (ShmInput("IN", (1, 4), "FP32", "region", 16, 0),), outputs)
    assert again[1] is body  # answered from the cache
    other_shape = cached_request("my model", (ShmInput("IN", (2, 4), "FP32", "region", 32, 0),), outputs)
    other_slot = cached_request("my model", (ShmInput("IN", (1, 4), "FP32", "region", 16, 64),), outputs)
    assert json.loads(other_shape[1])["inputs"][0]["shape"] == [2, 4]
    assert json.loads(other_slot[1])["inputs"][0]["parameters"]["shared_memory_offset"] == 64
    assert cached_request("other", inputs, outputs)[0] == "/v2/models/other/infer"
