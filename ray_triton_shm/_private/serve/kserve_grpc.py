"""KServe v2 over gRPC at the Serve ingress: Triton's ``inference.GRPCInferenceService``.

Serve's gRPC proxy (``grpc_options.grpc_servicer_functions`` naming
``ray_triton_shm.serve.add_kserve_grpc_servicer``, tritonclient's
``add_GRPCInferenceServiceServicer_to_server`` made picklable)
calls the deployment method named after each RPC with the decoded request
message. :class:`KServeGrpcMixin` gives :class:`~ray_triton_shm.serve.TritonDeployment`
those methods:

* ``ModelInfer`` (no version asked): the inputs (``raw_input_contents`` or the
  typed ``contents``) go into this node's shared-memory slots through the
  replica's :class:`NodeClient`; the outputs are read from the slots into the
  answer's ``raw_output_contents``, as Triton answers.
* ``ModelInfer`` with a version, or for a model whose tensors cannot live in
  slots (unbounded dims): passed to the node's Triton over loopback gRPC and
  answered with its answer (or its status code and message).
* Every other RPC: :func:`~ray_triton_shm._private.serve.kserve_grpc_routes.grpc_route`
  (forwarded to the node's Triton over the same channel, answered, or refused
  with a message), as over HTTP.

Errors are gRPC statuses with Triton's code and message for what Triton
refuses, ``INVALID_ARGUMENT`` for malformed requests (as Triton), and never
Ray's internals; segment keys are redacted from every message.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import ray
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.node import node_config
from ray_triton_shm._private.serve.kserve import SHM_PARAMETERS, deserialize_bytes, serialize_bytes
from ray_triton_shm._private.serve.kserve_errors import error_message, names_internals
from ray_triton_shm._private.serve.kserve_grpc_routes import ROUTED, SERVICE, GrpcAnswerError, grpc_route
from ray_triton_shm._private.serve.kserve_limits import check_shape
from ray_triton_shm._private.serve.kserve_routes import PROXY_TIMEOUT_S, IngressNode
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON, TRITON_TO_NUMPY
from ray_triton_shm._private.shm.segment import redact
from ray_triton_shm._private.triton.grpc_channel import NEVER_SENT_PREFIX, accepts_connections
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    PoolTimeoutError,
    RefusedError,
    TritonCallError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

__all__ = ["SERVICER_FUNCTION", "KServeGrpcMixin", "add_kserve_grpc_servicer"]

SERVICER_FUNCTION = "ray_triton_shm.serve.add_kserve_grpc_servicer"
"""What ``grpc_options.grpc_servicer_functions`` must name for this ingress."""

# tritonclient's generated messages name their module ``grpc_service_pb2`` (the .proto's
# name), which is not importable: Serve's proxy pickles each request message to the
# replica, and pickle finds a class by its module. Make those names resolve.
sys.modules.setdefault("grpc_service_pb2", pb)
sys.modules.setdefault("model_config_pb2", model_config_pb2)


def add_kserve_grpc_servicer(servicer: Any, server: Any) -> None:
    """Serve's servicer function for Triton's ``inference.GRPCInferenceService``.

    Tritonclient's own ``add_GRPCInferenceServiceServicer_to_server``, imported
    through this module so that the request messages pickle (see above).
    """
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A channel's reconnect backoff is its own (see _private/grpc_channel.py): a fresh channel
    # made after Triton came back must not inherit the old one's through the global pool.
    ("grpc.use_local_subchannel_pool", 1),
]

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
            a shape no tensor can have (see :func:`~ray_triton_shm._private.serve.kserve_limits.check_shape`),
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
    """
    if not request.outputs:
        return None
    for tensor in request.outputs:
        if any(key in tensor.parameters for key in SHM_PARAMETERS):
            raise InputError(
                f"output {tensor.name!r}: shared-memory parameters are not accepted by this ingress"
            )
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

    The message is what :func:`~ray_triton_shm._private.serve.kserve_errors.error_message`
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


class KServeGrpcMixin:
    """The RPCs of ``inference.GRPCInferenceService`` as Serve deployment methods.

    The class mixing it in has ``self._client`` (a :class:`NodeClient`),
    ``self._node`` (the :class:`~ray_triton_shm._private.serve.kserve_routes.RouteNode`
    of the routes; without it, one of ``self._client`` without model control) and
    ``async _served_version(model)``. Each method takes the request message and
    Serve's ``grpc_context`` and returns the response message; a failed call
    sets the status on the context and raises (Serve's proxy then answers that
    status and message).
    """

    _client: Any
    _channels: dict[str, grpc.aio.Channel]

    async def _served_version(self, model: str) -> str:  # pragma: no cover - provided by the deployment
        raise NotImplementedError

    async def ModelInfer(
        self, request: pb.ModelInferRequest, grpc_context: Any = None
    ) -> pb.ModelInferResponse:
        """Inference through this node's slots; with a version asked, Triton's own answer."""
        try:
            inputs, outputs = decode_infer_request(request)
            if request.model_version:  # Triton honours the version: pass it on, without the slots
                return await self._call("ModelInfer", request, pb.ModelInferResponse, PROXY_TIMEOUT_S)
            try:
                result = await self._client.ainfer(request.model_name, inputs, outputs=outputs, copy=False)
            except LayoutError:  # tensors that cannot live in slots (unbounded dims): Triton's
                return await self._call("ModelInfer", request, pb.ModelInferResponse, PROXY_TIMEOUT_S)
            version = await self._served_version(request.model_name)
            return encode_infer_response(request.model_name, version, request.id, result)
        except Exception as e:
            _fail(grpc_context, e)

    # -- the node's Triton over loopback gRPC ---------------------------------

    def _route_node(self) -> Any:
        node = getattr(self, "_node", None)  # the front door's servicer finds the deployment's
        return node if node is not None else IngressNode(self._client, False, node_config.MAX_REQUEST_BYTES)

    async def _call(self, method: str, request: Any, response_cls: Any, timeout: float) -> Any:
        """``method`` on the node's Triton.

        Raises:
            GrpcAnswerError: Triton answered with an error status, or could not be reached.
        """
        url = self._client.info.grpc_url
        fresh = False
        while True:
            channel = await self._channel(url, fresh=fresh)
            call = channel.unary_unary(
                f"/{SERVICE}/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            try:
                return await call(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                # A call the channel failed without sending it, while Triton accepts
                # connections: the channel is still backing off from a time Triton was down.
                if (
                    not fresh
                    and e.code() == grpc.StatusCode.UNAVAILABLE
                    and (e.details() or "").startswith(NEVER_SENT_PREFIX)
                    and await asyncio.to_thread(accepts_connections, url)
                ):
                    logger.info("gRPC ingress: replacing a channel to %s still backing off", url)
                    fresh = True
                    continue
                raise GrpcAnswerError(e.code().name, e.details() or "") from e

    async def _channel(self, url: str, *, fresh: bool = False) -> grpc.aio.Channel:
        """The channel to ``url``: the one kept, or a new one (``fresh``, or Triton moved)."""
        channels = self.__dict__.setdefault("_channels", {})
        channel = channels.get(url)
        if channel is None or fresh:
            for old in channels.values():  # Triton restarted on another port, or a stale channel
                await old.close()
            channels.clear()
            channel = channels[url] = grpc.aio.insecure_channel(url, options=_CHANNEL_OPTIONS)
        return channel


def _fail(grpc_context: Any, error: BaseException) -> None:
    """Set the status of ``error`` on Serve's context and raise it (Serve answers that status).

    Raises:
        GrpcAnswerError: Always.
    """
    code, message = status_of(error)
    if code == "INTERNAL" and not isinstance(error, GrpcAnswerError):
        logger.warning("gRPC ingress: %s", message, exc_info=error)
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN))
        grpc_context.set_details(message)
    raise GrpcAnswerError(code, message) from error


def _routed(name: str) -> Any:
    async def method(self: Any, request: Any, grpc_context: Any = None) -> Any:
        try:
            return await grpc_route(self._route_node(), name, request, self._call)
        except Exception as e:
            _fail(grpc_context, e)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``: see :mod:`~ray_triton_shm._private.serve.kserve_grpc_routes`."
    return method


for _name in ROUTED:
    setattr(KServeGrpcMixin, _name, _routed(_name))
