"""The KServe v2 gRPC conversions of the Serve ingress, on requests tritonclient.grpc itself builds."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc._infer_result import InferResult
from tritonclient.grpc._utils import _get_inference_request

from ray_triton_shm._private.serve.protocol.grpc_infer_codec import plan_inputs
from ray_triton_shm._private.serve.protocol.grpc_messages import (
    decode_infer_request,
    encode_infer_response,
    status_of,
)
from ray_triton_shm.errors import InputError, LayoutError, PoolTimeoutError, RefusedError, TritonCallError


def _request(inputs, outputs=None, **kwargs) -> pb.ModelInferRequest:
    fields = dict(model_version="", request_id="", sequence_id=0, sequence_start=False, sequence_end=False)
    fields.update(priority=0, timeout=None, parameters=None)
    fields.update(kwargs)
    return _get_inference_request("m", inputs, outputs=outputs, **fields)


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_raw_inputs_decode_to_arrays_over_the_request() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    text = np.array([b"a", b"", b"xyz"], dtype=object)
    request = _request(
        [_input("X", x, "FP32"), _input("T", text, "BYTES")], [grpcclient.InferRequestedOutput("Y")]
    )
    inputs, outputs = decode_infer_request(request)
    np.testing.assert_array_equal(inputs["X"], x)
    assert list(inputs["T"]) == [b"a", b"", b"xyz"]
    assert outputs == ["Y"]


def test_typed_contents_decode() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="X", datatype="INT32", shape=[2])
    tensor.contents.int_contents.extend([7, -1])
    inputs, outputs = decode_infer_request(request)
    np.testing.assert_array_equal(inputs["X"], np.array([7, -1], np.int32))
    assert outputs is None


def _reshape(request: pb.ModelInferRequest, shape: list[int]) -> None:
    request.inputs[0].ClearField("shape")
    request.inputs[0].shape.extend(shape)
    request.raw_input_contents[0] = b""


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.raw_input_contents.append(b"extra"),  # more raw contents than inputs
        lambda r: r.inputs[0].shape.__setitem__(0, 5),  # bytes do not fill the shape
        lambda r: setattr(r.inputs[0], "datatype", "FP99"),
        lambda r: r.inputs[0].parameters["shared_memory_region"].__setattr__("string_param", "rtshm_x"),
        lambda r: r.inputs.add(name="X", datatype="FP32", shape=[1]),  # twice
        lambda r: r.inputs[0].shape.extend([1] * 98),  # rank 100, the 4 elements fill it
        lambda r: r.inputs[0].shape.extend([1] * 63),  # rank 65
        lambda r: _reshape(r, [0, 2**62, 2**62]),  # no elements, but more than int64 counts
        lambda r: _reshape(r, [2**40, 2**40]),  # the element count overflows int64
        lambda r: _reshape(r, [0] * 65),
        lambda r: _reshape(r, [-1, 4]),
    ],
)
def test_bad_requests_are_input_errors(mutate) -> None:
    request = _request([_input("X", np.zeros((1, 4), np.float32), "FP32")])
    mutate(request)
    with pytest.raises(InputError):
        decode_infer_request(request)


def test_response_reads_back_with_tritonclient() -> None:
    y = np.arange(6, dtype=np.int64).reshape(2, 3)
    text = np.array([b"ab", b"c"], dtype=object)
    response = encode_infer_response("m", "1", "id-1", {"Y": y, "T": text})
    result = InferResult(response)
    np.testing.assert_array_equal(result.as_numpy("Y"), y)
    assert list(result.as_numpy("T")) == [b"ab", b"c"]
    assert result.get_response().model_version == "1" and result.get_response().id == "id-1"


def test_status_of_errors() -> None:
    assert status_of(InputError("bad"))[0] == "INVALID_ARGUMENT"
    assert status_of(LayoutError("no"))[0] == "UNIMPLEMENTED"
    assert status_of(PoolTimeoutError("m", 1.0))[0] == "UNAVAILABLE"
    assert status_of(TritonCallError("unknown model", "NOT_FOUND", "m")) == ("NOT_FOUND", "unknown model")
    assert status_of(TritonCallError("x in rtshm_1_2_in_abc", "INVALID_ARGUMENT"))[1].count("rtshm_1_2") == 0
    assert status_of(KeyError("secret")) == ("INTERNAL", "internal error (KeyError)")


def test_an_output_asked_for_as_its_top_classes_is_refused_not_answered_whole() -> None:
    """tritonclient's ``class_count`` (the classification extension): refused, UNIMPLEMENTED."""
    x = np.zeros((1, 4), np.float32)
    for count in (0, 3):
        request = _request(
            [_input("X", x, "FP32")], [grpcclient.InferRequestedOutput("Y", class_count=count)]
        )
        if not count:  # no classification asked
            assert decode_infer_request(request)[1] == ["Y"] and plan_inputs(request) is not None
            continue
        with pytest.raises(RefusedError, match="classification") as refused:
            decode_infer_request(request)
        assert status_of(refused.value) == ("UNIMPLEMENTED", str(refused.value))
        assert "'Y'" in str(refused.value) and plan_inputs(request) is None  # the general path refuses it
