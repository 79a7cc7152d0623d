"""The KServe v2 request/response codec and error mapping, without a server."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from ray_triton_shm._private.serve.protocol import kserve, kserve_errors, kserve_json
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    OutputTooLargeError,
    PoolTimeoutError,
    RefusedError,
    TritonCallError,
    UnavailableError,
)


def body(header: dict, *blobs: bytes) -> tuple[bytes, int | None]:
    """A request body and its header length (``None`` without binary parts)."""
    head = json.dumps(header).encode()
    return head + b"".join(blobs), (len(head) if blobs else None)


def int32_input(name: str = "INPUT0", **fields) -> dict:
    return {"name": name, "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4], **fields}


# -- decoding --------------------------------------------------------------------------------


def test_json_tensors_are_decoded_with_their_datatype_and_shape() -> None:
    data, length = body(
        {
            "id": "r1",
            "inputs": [
                int32_input(),
                {"name": "F", "datatype": "FP32", "shape": [2, 2], "data": [[0.5, 1], [2, -3.25]]},
                {"name": "B", "datatype": "BOOL", "shape": [2], "data": [True, False]},
            ],
        }
    )
    decoded = kserve.decode_request(data, length)
    assert decoded.request_id == "r1"
    assert decoded.outputs is None and decoded.default_binary is False
    np.testing.assert_array_equal(decoded.inputs["INPUT0"], np.array([[1, 2, 3, 4]], np.int32))
    assert decoded.inputs["INPUT0"].dtype == np.int32
    np.testing.assert_array_equal(decoded.inputs["F"], np.array([[0.5, 1.0], [2.0, -3.25]], np.float32))
    assert decoded.inputs["F"].dtype == np.float32
    np.testing.assert_array_equal(decoded.inputs["B"], np.array([True, False]))


def test_json_data_nested_unevenly_is_read_in_row_major_order() -> None:
    data, length = body({"inputs": [int32_input(data=[[1, [2]], [], 3, [[4]]])]})
    decoded = kserve.decode_request(data, length)
    np.testing.assert_array_equal(decoded.inputs["INPUT0"], np.array([[1, 2, 3, 4]], np.int32))


def test_binary_tensors_are_read_from_after_the_header() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[7, -8]], dtype=np.int64)
    header = {
        "inputs": [
            {"name": "A", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
            {"name": "B", "datatype": "INT64", "shape": [1, 2], "parameters": {"binary_data_size": b.nbytes}},
        ],
        "outputs": [{"name": "X", "parameters": {"binary_data": True}}, {"name": "Y"}],
        "parameters": {"binary_data_output": False},
    }
    data, length = body(header, a.tobytes(), b.tobytes())
    decoded = kserve.decode_request(data, length)
    np.testing.assert_array_equal(decoded.inputs["A"], a)
    np.testing.assert_array_equal(decoded.inputs["B"], b)
    assert decoded.outputs == ["X", "Y"]
    assert decoded.binary_outputs == {"X": True, "Y": False}


def test_empty_output_list_means_every_output() -> None:
    data, length = body({"inputs": [int32_input()], "outputs": []})
    assert kserve.decode_request(data, length).outputs is None


def _binary(name: str, size: int) -> dict:
    return {"name": name, "datatype": "INT32", "shape": [1, 4], "parameters": {"binary_data_size": size}}


FOUR_INTS = np.arange(4, dtype=np.int32).tobytes()

# Every way decode_request refuses a request: (id, body, header length, words of the message).
BAD_REQUESTS = [
    ("length-past-body", b'{"inputs": []}', 999, "outside the body"),
    ("not-json", b"{inputs: nope", None, "failed to parse the request JSON buffer"),
    ("not-utf8", b'{"inputs": ["\xff"]}', None, "failed to parse the request JSON buffer"),
    # A number past a double: Triton's parser refuses it ("Number too big to be stored in double").
    (
        "float-past-double",
        b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": [1e400]}]}',
        None,
        "failed to parse the request JSON buffer: Number too big to be stored in double",
    ),
    (
        "float-of-400-digits-past-double",
        b'{"inputs": [{"name": "F", "datatype": "FP64", "shape": [1], "data": [1' + b"0" * 399 + b".5]}]}",
        None,
        "Number too big to be stored in double",
    ),
    (
        "negative-float-past-double",
        b'{"inputs": [{"name": "F", "datatype": "FP64", "shape": [1], "data": [-1.5e309]}]}',
        None,
        "Number too big to be stored in double",
    ),
    ("not-an-object", b"[1, 2]", None, "'inputs' list"),
    ("no-inputs", b'{"outputs": []}', None, "'inputs' list"),
    ("inputs-not-a-list", b'{"inputs": {"name": "x"}}', None, "'inputs' list"),
    ("entry-not-an-object", *body({"inputs": [[1, 2]]}), "string 'name'"),
    ("entry-without-name", *body({"inputs": [{"datatype": "INT32", "shape": [1], "data": [1]}]}), "'name'"),
    ("name-not-a-string", *body({"inputs": [int32_input(name=5)]}), "string 'name'"),
    ("input-twice", *body({"inputs": [int32_input(), int32_input()]}), "given twice"),
    ("unknown-datatype", *body({"inputs": [int32_input(datatype="INT128")]}), "not supported"),
    ("datatype-not-a-string", *body({"inputs": [int32_input(datatype=3)]}), "not supported"),
    ("shape-missing", *body({"inputs": [{"name": "I", "datatype": "INT32", "data": [1]}]}), "'shape'"),
    ("shape-of-strings", *body({"inputs": [int32_input(shape=["1", "4"])]}), "'shape'"),
    ("shape-negative", *body({"inputs": [int32_input(shape=[-1, 4])]}), "'shape'"),
    ("shape-of-floats", *body({"inputs": [int32_input(shape=[1.0, 4])]}), "'shape'"),
    ("no-data", *body({"inputs": [{"name": "I", "datatype": "INT32", "shape": [1]}]}), "neither"),
    ("data-not-an-array", *body({"inputs": [int32_input(data=7)]}), "JSON array"),
    ("data-strings-for-int32", *body({"inputs": [int32_input(data=["a", "b", "c", "d"])]}), "INT32 value"),
    ("data-digit-strings", *body({"inputs": [int32_input(data=["1", "2", "3", "4"])]}), "INT32 value"),
    ("data-floats-for-int32", *body({"inputs": [int32_input(data=[1.5, 2, 3, 4])]}), "INT32 value"),
    ("data-bools-for-int32", *body({"inputs": [int32_input(data=[True, 2, 3, 4])]}), "INT32 value"),
    ("data-null", *body({"inputs": [int32_input(data=[None, 2, 3, 4])]}), "INT32 value"),
    (
        "data-ints-for-bool",
        *body({"inputs": [{"name": "B", "datatype": "BOOL", "shape": [2], "data": [1, 0]}]}),
        "BOOL value",
    ),
    (
        "data-strings-for-fp32",
        *body({"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": ["1.0"]}]}),
        "FP32 value",
    ),
    ("data-out-of-range", *body({"inputs": [int32_input(data=[2**40, 2, 3, 4])]}), "out of range"),
    ("data-nested-string", *body({"inputs": [int32_input(data=[[1, 2], [3, "4"]])]}), "'4' is not a INT32"),
    (
        "data-nested-bool-for-fp32",
        *body({"inputs": [int32_input(datatype="FP32", data=[[1.5], [True, 2, 3]])]}),
        "True",
    ),
    ("data-object-in-array", *body({"inputs": [int32_input(data=[[1, 2], {}, 3])]}), "{} is not a INT32"),
    (
        "data-negative-unsigned",
        *body({"inputs": [{"name": "U", "datatype": "UINT8", "shape": [1], "data": [-1]}]}),
        "out of range",
    ),
    ("data-too-short", *body({"inputs": [int32_input(data=[1, 2, 3])]}), "do not fill"),
    ("data-too-long", *body({"inputs": [int32_input(data=[1, 2, 3, 4, 5])]}), "do not fill"),
    ("parameters-not-an-object", *body({"inputs": [int32_input(parameters=[1])]}), "JSON object"),
    ("binary-size-string", *body({"inputs": [_binary("I", "16")]}, FOUR_INTS), "binary_data_size"),
    ("binary-size-negative", *body({"inputs": [_binary("I", -16)]}, FOUR_INTS), "binary_data_size"),
    ("binary-past-end", *body({"inputs": [_binary("I", 32)]}, FOUR_INTS), "past the end"),
    ("binary-size-not-shape", *body({"inputs": [_binary("I", 8)]}, FOUR_INTS), "do not match shape"),
    ("bytes-after-inputs", *body({"inputs": [_binary("I", 16)]}, FOUR_INTS, b"junk"), "after the last"),
    (
        "request-parameters-not-an-object",
        *body({"inputs": [int32_input()], "parameters": "binary"}),
        "JSON object",
    ),
    (
        "binary-output-not-bool",
        *body({"inputs": [int32_input()], "parameters": {"binary_data_output": "yes"}}),
        "boolean",
    ),
    ("outputs-not-a-list", *body({"inputs": [int32_input()], "outputs": {"name": "O"}}), "array"),
    ("output-without-name", *body({"inputs": [int32_input()], "outputs": [{}]}), "string 'name'"),
    (
        "output-binary-not-bool",
        *body({"inputs": [int32_input()], "outputs": [{"name": "O", "parameters": {"binary_data": 1}}]}),
        "boolean",
    ),
    ("id-not-a-string", *body({"inputs": [int32_input()], "id": 5}), "'id'"),
    # Parser traps: each must be a 400, never an internal error.
    ("nested-200000", b"[" * 200_000, None, "failed to parse"),
    (
        "data-nested-100000",
        b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": '
        + b"[" * 100_000
        + b"1"
        + b"]" * 100_000
        + b"}]}",
        None,
        "failed to parse",
    ),
    (
        "int-5000-digits",
        b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [' + b"9" * 5000 + b"]}]}",
        None,
        "failed to parse",
    ),
    ("nan", b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": [NaN]}]}', None, "NaN"),
    (
        "duplicate-key",
        b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [1], "data": [2]}]}',
        None,
        "duplicate key 'data'",
    ),
    ("rank-100", *body({"inputs": [int32_input(shape=[1] * 100, data=[1])]}), "100 dimensions"),
    ("rank-65-of-zeros", *body({"inputs": [int32_input(shape=[0] * 65, data=[])]}), "65 dimensions"),
    ("dim-2**70", *body({"inputs": [int32_input(shape=[0, 2**70], data=[])]}), "too large"),
    ("dims-past-int64", *body({"inputs": [int32_input(shape=[0, 2**62, 2**62], data=[])]}), "too large"),
    (
        "binary-dims-past-int64",
        *body({"inputs": [_binary("I", 16) | {"shape": [2**40, 2**40]}]}, FOUR_INTS),
        "too large",
    ),
]


@pytest.mark.parametrize(
    ("data", "length", "words"), [r[1:] for r in BAD_REQUESTS], ids=[r[0] for r in BAD_REQUESTS]
)
def test_every_malformed_request_is_an_input_error(data: bytes, length: int | None, words: str) -> None:
    with pytest.raises(InputError) as info:
        kserve.decode_request(data, length)
    assert words in str(info.value)
    assert kserve_errors.http_status(info.value) == 400
    # Planning from the header alone refuses it the same way (or leaves it to decode_request).
    split = len(data) if length is None else length
    try:
        kserve.plan_request(data[:split], split, len(data))
    except InputError as e:
        assert type(e) is type(info.value)


@pytest.mark.parametrize(
    ("data", "length", "words"), [r[1:] for r in BAD_REQUESTS], ids=[r[0] for r in BAD_REQUESTS]
)
def test_every_malformed_request_is_refused_alike_by_the_json_module(
    data: bytes, length: int | None, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C reader of JSON tensors (when built) changes no refusal: same type, same message."""
    with pytest.raises(InputError) as fast:
        kserve.decode_request(data, length)
    monkeypatch.setattr(kserve_json, "_kserve_json", None)
    with pytest.raises(InputError) as slow:
        kserve.decode_request(data, length)
    assert (type(fast.value), str(fast.value)) == (type(slow.value), str(slow.value))


# Requests whose JSON tensors the C reader may read: (id, body). Each decodes as the json module reads it.
GOOD_REQUESTS = [
    ("ints", *body({"inputs": [int32_input()]})),
    (
        "floats-and-ints-for-fp32",
        *body({"inputs": [int32_input(datatype="FP32", data=[0.1, 2, -3.5e-7, 4e30])]}),
    ),
    ("fp16", *body({"inputs": [int32_input(datatype="FP16", data=[0.1, 70000.0, -2, 1e-8])]})),
    ("fp32-overflow", *body({"inputs": [int32_input(datatype="FP32", data=[1e39, -1e300, 0.0, -0.0])]})),
    ("fp64", *body({"inputs": [int32_input(datatype="FP64", data=[0.1, 1 / 3, 2**53 + 1, -0.0])]})),
    ("int64-extremes", *body({"inputs": [int32_input(datatype="INT64", data=[-(2**63), 2**63 - 1, 0, -1])]})),
    ("uint64-past-int64", *body({"inputs": [int32_input(datatype="UINT64", data=[2**64 - 1, 2**63, 0, 1])]})),
    ("uint8-edges", *body({"inputs": [int32_input(datatype="UINT8", data=[0, 255, 1, 254])]})),
    ("int8-edges", *body({"inputs": [int32_input(datatype="INT8", data=[-128, 127, 0, -1])]})),
    (
        "ints-past-2**53-for-fp32",
        *body({"inputs": [int32_input(datatype="FP32", data=[2**60 + 1, 3, 2**53 + 1, 1])]}),
    ),
    (
        "ints-past-2**53-and-floats",
        *body({"inputs": [int32_input(datatype="FP64", data=[2**60 + 1, 0.5, 1, 2])]}),
    ),
    ("19-digit-ints", *body({"inputs": [int32_input(datatype="INT64", data=[10**18 + 7, -(10**18), 1, 2])]})),
    ("nested", *body({"inputs": [int32_input(data=[[1, 2], [3, 4]])]})),
    ("bools", *body({"inputs": [{"name": "B", "datatype": "BOOL", "shape": [2], "data": [True, False]}]})),
    ("bytes", *body({"inputs": [{"name": "S", "datatype": "BYTES", "shape": [2], "data": ["a", "é"]}]})),
    ("empty", *body({"inputs": [int32_input(shape=[0], data=[])]})),
    (
        "escaped-names-and-exponents",
        b'{"inputs": [{"name": "IN\u0030", "datatype": "FP32", "shape": [3], "data": [1E+2, -0.5e-3, 7E0]}],'
        b' "id": "a\\"b", "outputs": [{"name": "O", "parameters": {"binary_data": true}}]}',
        None,
    ),
    (
        "long-digits",
        b'{"inputs": [{"name": "F", "datatype": "FP64", "shape": [3], "data":'
        b" [0.1000000000000000055511151231257827, 123456789012345678901234567890.5, 1e-320]}]}",
        None,
    ),
    (
        "data-in-parameters",
        *body({"inputs": [int32_input(parameters={"data": [1, 2]})], "parameters": {"data": [3.5]}}),
    ),
    (
        "whitespace",
        b' \n{ "inputs" :[ {"name":"I","datatype":"INT32","shape":[4],"data":[ 1 ,\t2,\r3 , 4 ] } ] }\n ',
        None,
    ),
]


@pytest.mark.parametrize(
    ("data", "length"), [r[1:] for r in GOOD_REQUESTS], ids=[r[0] for r in GOOD_REQUESTS]
)
def test_json_tensors_decode_alike_with_and_without_the_c_reader(
    data: bytes, length: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = kserve.decode_request(data, length)
    monkeypatch.setattr(kserve_json, "_kserve_json", None)
    slow = kserve.decode_request(data, length)
    assert fast.inputs.keys() == slow.inputs.keys()
    for name, array in slow.inputs.items():
        assert fast.inputs[name].dtype == array.dtype and fast.inputs[name].shape == array.shape
        if array.dtype == object:
            assert fast.inputs[name].tolist() == array.tolist()
        else:
            assert fast.inputs[name].tobytes() == array.tobytes(), name
    assert (fast.outputs, fast.binary_outputs, fast.default_binary, fast.request_id) == (
        slow.outputs,
        slow.binary_outputs,
        slow.default_binary,
        slow.request_id,
    )


@pytest.mark.parametrize("value", ["abc", "-5", "1.5", "", " ", "0x10", "١٢"])
def test_header_length_that_is_not_a_non_negative_integer_is_an_input_error(value: str) -> None:
    with pytest.raises(InputError, match="Inference-Header-Content-Length"):
        kserve.parse_header_length(value)


def test_header_length_parses_digits_and_absence() -> None:
    assert kserve.parse_header_length(None) is None
    assert kserve.parse_header_length("42") == 42
    assert kserve.parse_header_length(" 7 ") == 7


# -- encoding --------------------------------------------------------------------------------


def test_response_json_and_binary_outputs() -> None:
    data, length = body(
        {
            "id": "abc",
            "inputs": [int32_input()],
            "outputs": [{"name": "J", "parameters": {"binary_data": False}}, {"name": "K"}],
            "parameters": {"binary_data_output": True},
        }
    )
    decoded = kserve.decode_request(data, length)
    j = np.array([[1, -2]], dtype=np.int32)
    k = np.array([0.5, 1.5], dtype=np.float32)
    payload, headers = kserve.encode_response("m", decoded, {"J": j, "K": k}, "3")
    split = int(headers[kserve.HEADER_LENGTH])
    assert headers["content-type"] == "application/octet-stream"
    reply = json.loads(payload[:split])
    assert reply == {
        "model_name": "m",
        "model_version": "3",
        "id": "abc",
        "outputs": [
            {"name": "J", "datatype": "INT32", "shape": [1, 2], "data": [1, -2]},
            {"name": "K", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        ],
    }
    np.testing.assert_array_equal(np.frombuffer(payload[split:], np.float32), k)


def test_response_all_json_has_no_header_length() -> None:
    data, length = body({"inputs": [int32_input()]})
    payload, headers = kserve.encode_response("m", kserve.decode_request(data, length), {"O": np.ones(2)})
    assert headers == {"content-type": "application/json"}
    assert json.loads(payload)["outputs"] == [
        {"name": "O", "datatype": "FP64", "shape": [2], "data": [1.0, 1.0]}
    ]


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InputError("bad"), 400),
        (LayoutError("bytes tensors"), 501),
        (PoolTimeoutError("m", 1.0), 503),
        (UnavailableError("gone", "UNAVAILABLE", "m"), 503),
        (TritonCallError("Request for unknown model: 'x' is not found", "NOT_FOUND", "x"), 404),
        (TritonCallError("bad shape", "INVALID_ARGUMENT", "m"), 400),
        (TritonCallError("boom", "INTERNAL", "m"), 500),
        (TritonCallError("not supported", "UNIMPLEMENTED", "m"), 501),
        (TritonCallError("late", "DEADLINE_EXCEEDED", "m"), 504),
        (TritonCallError("odd", None, "m"), 500),
        (OutputTooLargeError("too big", "INVALID_ARGUMENT", "m"), 400),
        (RuntimeError("x"), 500),
    ],
)
def test_http_status_follows_tritons_codes(error: Exception, code: int) -> None:
    assert kserve_errors.http_status(error) == code


def test_error_message_is_tritons_own_text_for_its_refusals() -> None:
    error = TritonCallError("Request for unknown model: 'x' is not found", "NOT_FOUND", "x")
    assert kserve_errors.error_message(error) == "Request for unknown model: 'x' is not found"
    assert kserve_errors.error_message(pickle.loads(pickle.dumps(error))) == error.message
    assert "unknown datatype" in kserve_errors.error_message(InputError("unknown datatype"))
    assert json.loads(kserve_errors.error_body('a "quoted" message')) == {"error": 'a "quoted" message'}


# -- routing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "root", "route"),
    [
        ("/v2/health/ready", "", "/v2/health/ready"),
        ("/triton/v2/health/ready", "/triton", "/v2/health/ready"),
        ("/a/b/v2/models/m/infer", "/a/b", "/v2/models/m/infer"),
        ("/triton/v2/models/m/", "/triton/", "/v2/models/m/"),  # a trailing slash stays (Triton: 404)
        ("/triton", "/triton", "/"),
        ("/tritonx/v2", "/triton", "/tritonx/v2"),  # not below the prefix
    ],
)
def test_route_path_is_the_path_below_the_route_prefix(path: str, root: str, route: str) -> None:
    assert kserve.route_path({"path": path, "root_path": root}) == route


def test_triton_path_quotes_each_segment_and_keeps_the_query() -> None:
    assert kserve.triton_path("/v2/models/a b/versions/1/ready", "") == "/v2/models/a%20b/versions/1/ready"
    assert kserve.triton_path("/v2/models/x?y", "q=1") == "/v2/models/x%3Fy?q=1"


def test_shm_parameters_are_refused_in_requests_passed_through() -> None:
    from ray_triton_shm._private.serve.protocol.kserve import refuse_shm_parameters

    clean = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}
    refuse_shm_parameters(json.dumps(clean).encode(), None)  # nothing to refuse
    for kind in ("inputs", "outputs"):
        named = {
            "name": "T",
            "parameters": {"shared_memory_region": "rtshm_1_2_pool_x", "shared_memory_byte_size": 64},
        }
        request = {**clean, kind: [*clean.get(kind, []), named]}
        body = json.dumps(request).encode()
        with pytest.raises(InputError, match="shared-memory parameters are not accepted"):
            refuse_shm_parameters(body + b"\x00" * 8, len(body))  # binary data after the header
    with pytest.raises(InputError, match="failed to parse the request JSON buffer"):
        refuse_shm_parameters(b"{not json", None)


@pytest.mark.parametrize(
    "header",
    [
        # Triton's parser reads the first of two equal keys, Python's the last: the first names a region.
        b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [1],'
        b' "parameters": {"shared_memory_region": "rtshm_1_2_node_x"}, "parameters": {}}]}',
        b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [1]}],'
        b' "outputs": [{"name": "O", "parameters": {"shared_memory_region": "r"}, "parameters": {}}]}',
        b'{"inputs": [{"name": "I", "parameters": {"shared_memory_region": "r"}}],'
        b' "inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [1]}]}',
    ],
    ids=["input-parameters", "output-parameters", "inputs"],
)
def test_duplicate_keys_cannot_hide_shm_parameters(header: bytes) -> None:
    from ray_triton_shm._private.serve.protocol.kserve import refuse_shm_parameters

    with pytest.raises(InputError, match="duplicate key"):
        refuse_shm_parameters(header, None)
    with pytest.raises(InputError, match="duplicate key"):
        kserve.decode_request(header, None)


def test_an_output_asked_for_as_its_top_classes_is_refused_not_answered_whole() -> None:
    """The classification extension (``"classification": 3`` in an output's parameters): 501."""
    tensor = {"name": "I", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}
    for parameters, refused in (({"classification": 0}, False), ({"classification": 3}, True)):
        header = json.dumps(
            {"inputs": [tensor], "outputs": [{"name": "O", "parameters": parameters}]}
        ).encode()
        body = header + b"\x00" * 8
        if not refused:
            assert kserve.decode_request(body, len(header)).outputs == ["O"]
            continue
        with pytest.raises(RefusedError, match="classification") as info:
            kserve.decode_request(body, len(header))
        assert kserve_errors.http_status(info.value) == 501 and "'O'" in str(info.value)
        with pytest.raises(RefusedError, match="classification"):
            kserve.plan_request(header, len(header), len(body))
