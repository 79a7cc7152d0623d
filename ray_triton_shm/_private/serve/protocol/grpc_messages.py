"""Triton's gRPC inference messages and statuses, transport-neutral.

A ``ModelInferRequest``'s tensors decoded (raw or typed contents), a
``ModelInferResponse``'s outputs described and encoded as Triton encodes them,
and the gRPC status Triton's endpoint answers for each of our errors. The Serve
ingress and the front door's gRPC listener both use them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.protocol.kserve import (
    CLASSIFICATION,
    SHM_PARAMETERS,
    classification_refused,
)
from ray_triton_shm._private.serve.protocol.kserve_errors import error_message, names_internals
from ray_triton_shm._private.serve.protocol.kserve_grpc_routes import GrpcAnswerError
from ray_triton_shm._private.serve.protocol.kserve_limits import check_shape
from ray_triton_shm._private.serve.protocol.kserve_tensors import deserialize_bytes, serialize_bytes
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON, TRITON_TO_NUMPY
from ray_triton_shm._private.shm.segment import redact
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    PoolTimeoutError,
    RefusedError,
    TritonCallError,
    UnavailableError,
)

logger = logging.getLogger(__name__)


# The typed ``InferTensorContents`` field of each datatype (FP16 and BF16 travel raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def decode_infer_request(
    request: pb.ModelInferRequest, raw: Sequence[bytes | memoryview] | None = None
) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """The inputs (as arrays over the request's bytes where possible) and the outputs asked for.

    Args:
        request: The request.
        raw: The raw input contents when they were kept out of ``request``
            (views of the message's bytes); default: ``request.raw_input_contents``.

    Raises:
        InputError: A datatype Triton does not know, shared-memory parameters,
            a shape no tensor can have (see
            :func:`~ray_triton_shm._private.serve.protocol.kserve_limits.check_shape`),
            data that does not match its shape, raw and typed contents mixed.
    """
    if raw is None:
        raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InputError(f"expected {len(request.inputs)} raw input contents (one per input), got {len(raw)}")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise InputError(f"input {name!r} is given twice")
        shape, dtype = input_spec(tensor)
        count = math.prod(shape)
        datatype = tensor.datatype
        has_contents = tensor.HasField("contents")
        if raw:
            if has_contents:
                raise InputError(f"input {name!r}: contents given both raw and typed")
            array = _from_raw(name, raw[index], datatype, dtype, count)
        elif has_contents:
            array = _from_contents(name, tensor.contents, datatype, dtype)
        else:
            raise InputError(f"input {name!r} has no data")
        if array.size != count:
            raise InputError(f"input {name!r}: {array.size} elements do not fill shape {shape}")
        inputs[name] = array.reshape(shape)
    return inputs, output_names(request)


def input_spec(tensor: pb.ModelInferRequest.InferInputTensor) -> tuple[list[int], np.dtype | None]:
    """An input's shape and numpy dtype (``None``: ``BYTES``), checked as Triton's endpoint would.

    Raises:
        InputError: Shared-memory parameters, a shape no tensor can have, a datatype Triton does not know.
    """
    name = tensor.name
    if any(key in tensor.parameters for key in SHM_PARAMETERS):
        raise InputError(f"input {name!r}: shared-memory parameters are not accepted by this ingress")
    shape = [int(d) for d in tensor.shape]
    check_shape(name, shape)
    datatype = tensor.datatype
    dtype = TRITON_TO_NUMPY.get(datatype)
    if dtype is None and datatype != "BYTES":
        raise InputError(f"input {name!r}: datatype {datatype!r} is not supported")
    return shape, dtype


def output_names(request: pb.ModelInferRequest) -> list[str] | None:
    """The outputs a request asks for (``None``: all of them).

    Raises:
        InputError: An output with shared-memory parameters.
        RefusedError: An output asked for as its top classes (the classification extension).
    """
    if not request.outputs:
        return None
    for tensor in request.outputs:
        if any(key in tensor.parameters for key in SHM_PARAMETERS):
            raise InputError(
                f"output {tensor.name!r}: shared-memory parameters are not accepted by this ingress"
            )
        if CLASSIFICATION in tensor.parameters:
            param = tensor.parameters[CLASSIFICATION]
            choice = param.WhichOneof("parameter_choice")
            if choice is not None and getattr(param, choice):
                raise classification_refused(tensor.name)
    return [tensor.name for tensor in request.outputs]


def _from_raw(
    name: str, data: bytes | memoryview, datatype: str, dtype: np.dtype | None, count: int
) -> np.ndarray:
    if dtype is None:
        return deserialize_bytes(data, count)
    if len(data) != count * dtype.itemsize:
        raise InputError(
            f"input {name!r}: {len(data)} bytes of raw contents do not match"
            f" {count} elements of {datatype} ({count * dtype.itemsize} bytes)"
        )
    return np.frombuffer(data, dtype=dtype, count=count)


def _from_contents(name: str, contents: Any, datatype: str, dtype: np.dtype | None) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InputError(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    values = getattr(contents, field)
    if dtype is None:
        out = np.empty(len(values), dtype=object)
        out[:] = list(values)
        return out
    try:
        return np.asarray(values, dtype=dtype)
    except (OverflowError, ValueError) as e:
        raise InputError(f"input {name!r}: a value is out of range for {datatype}") from e


def add_outputs(response: pb.ModelInferResponse, outputs: Mapping[str, Any]) -> list[bytes | memoryview]:
    """Describe ``outputs`` in ``response`` (name, datatype, shape); returns their raw contents, in order.

    A numeric output's contents are a view of its (contiguous, host) array, not a copy.
    """
    blobs: list[bytes | memoryview] = []
    for name, value in outputs.items():
        array = np.ascontiguousarray(to_host(value))
        is_bytes = array.dtype == object
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES" if is_bytes else NUMPY_TO_TRITON[array.dtype]
        tensor.shape.extend(int(d) for d in array.shape)
        blobs.append(serialize_bytes(array) if is_bytes else memoryview(array.reshape(-1).view(np.uint8)))
    return blobs


def encode_infer_response(
    model: str, version: str, request_id: str, outputs: Mapping[str, Any]
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of ``outputs``, tensor data in ``raw_output_contents`` (as Triton)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    response.raw_output_contents.extend(bytes(blob) for blob in add_outputs(response, outputs))
    return response


def status_of(error: BaseException) -> tuple[str, str]:
    """The gRPC status (code name, message) Triton's endpoint would answer for ``error``.

    The message is what :func:`~ray_triton_shm._private.serve.protocol.kserve_errors.error_message`
    lets a client read: nothing of the node's internals.
    """
    cause = error
    while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, BaseException):
        cause = cause.cause
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
        return "UNAVAILABLE", "the Triton node actor on this node is unavailable"
    if isinstance(cause, GrpcAnswerError):  # Triton's answer, or the loopback channel's failure
        message = redact(cause.message)
        if names_internals(message):
            logger.warning("gRPC ingress: answered %s for: %s", cause.code, message)
            message = _GENERIC_STATUS.get(cause.code, "internal error")
        return cause.code, message
    if isinstance(cause, RefusedError):
        return cause.status, redact(cause.message)
    if isinstance(cause, InputError):
        code = "INVALID_ARGUMENT"
    elif isinstance(cause, LayoutError):
        code = "UNIMPLEMENTED"
    elif isinstance(cause, (PoolTimeoutError, UnavailableError)):
        code = "UNAVAILABLE"
    elif isinstance(cause, TritonCallError):
        code = cause.status or "INTERNAL"
    else:
        code = "INTERNAL"
    return code, error_message(cause)


_GENERIC_STATUS = {
    "UNAVAILABLE": "the inference server on this node is unavailable; try again shortly",
    "DEADLINE_EXCEEDED": "the inference server on this node did not answer in time",
}
