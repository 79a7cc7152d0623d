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
  slots (unbounded dims), ``ServerLive``, ``ServerReady``,
  ``ModelReady``, ``ModelMetadata``, ``ModelConfig``: passed to the node's
  Triton over loopback gRPC and answered with its answer (or its status code
  and message), so they are Triton's own. ``ServerMetadata`` is Triton's with
  this ingress's name and extensions, as over HTTP.

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
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.cuda import to_host
from ray_triton_shm._private.grpc_channel import NEVER_SENT_PREFIX, accepts_connections
from ray_triton_shm._private.kserve import SHM_PARAMETERS, deserialize_bytes, serialize_bytes
from ray_triton_shm._private.layout import NUMPY_TO_TRITON, TRITON_TO_NUMPY
from ray_triton_shm._private.segment import redact
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    PoolTimeoutError,
    RayTritonShmError,
    TritonCallError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
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
    from tritonclient.grpc import service_pb2_grpc

    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


PROBE_TIMEOUT_S = 2.0
PROXY_TIMEOUT_S = 60.0
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


class GrpcAnswerError(RayTritonShmError):
    """An RPC answered with a non-OK status (Triton's, or ours for a bad request).

    Args:
        code: The gRPC status code name (``NOT_FOUND``, ...).
        message: The status details.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


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
        if any(key in tensor.parameters for key in SHM_PARAMETERS):
            raise InputError(f"input {name!r}: shared-memory parameters are not accepted by this ingress")
        shape = [int(d) for d in tensor.shape]
        if any(d < 0 for d in shape):
            raise InputError(f"input {name!r}: shape {shape} has a negative dimension")
        count = math.prod(shape)
        datatype = tensor.datatype
        dtype = TRITON_TO_NUMPY.get(datatype)
        if dtype is None and datatype != "BYTES":
            raise InputError(f"input {name!r}: datatype {datatype!r} is not supported")
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
    outputs = None
    if request.outputs:
        outputs = []
        for tensor in request.outputs:
            if any(key in tensor.parameters for key in SHM_PARAMETERS):
                raise InputError(
                    f"output {tensor.name!r}: shared-memory parameters are not accepted by this ingress"
                )
            outputs.append(tensor.name)
    return inputs, outputs


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


def encode_infer_response(
    model: str, version: str, request_id: str, outputs: Mapping[str, Any]
) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of ``outputs``, tensor data in ``raw_output_contents`` (as Triton)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name, value in outputs.items():
        array = np.ascontiguousarray(to_host(value))
        is_bytes = array.dtype == object
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES" if is_bytes else NUMPY_TO_TRITON[array.dtype]
        tensor.shape.extend(int(d) for d in array.shape)
        response.raw_output_contents.append(serialize_bytes(array) if is_bytes else array.tobytes())
    return response


def status_of(error: BaseException) -> tuple[str, str]:
    """The gRPC status (code name, message) Triton's endpoint would answer for ``error``."""
    cause = error
    while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, BaseException):
        cause = cause.cause
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
        return "UNAVAILABLE", "the Triton node actor on this node is unavailable"
    if isinstance(cause, GrpcAnswerError):
        return cause.code, redact(cause.message)
    if isinstance(cause, InputError):
        return "INVALID_ARGUMENT", redact(str(cause))
    if isinstance(cause, LayoutError):
        return "UNIMPLEMENTED", redact(str(cause))
    if isinstance(cause, (PoolTimeoutError, UnavailableError)):
        return "UNAVAILABLE", redact(str(cause))
    if isinstance(cause, TritonCallError):
        return cause.status or "INTERNAL", redact(cause.message)
    if isinstance(cause, RayTritonShmError):
        return "INTERNAL", redact(str(cause))
    return "INTERNAL", f"internal error ({type(cause).__name__})"


class KServeGrpcMixin:
    """The RPCs of ``inference.GRPCInferenceService`` as Serve deployment methods.

    The class mixing it in has ``self._client`` (a :class:`NodeClient`) and
    ``async _served_version(model)``. Each method takes the request message and
    Serve's ``grpc_context`` and returns the response message; a failed call
    sets the status on the context and raises (Serve's proxy then answers that
    status and message).
    """

    _client: Any
    _channels: dict[str, grpc.aio.Channel]

    async def _served_version(self, model: str) -> str:  # pragma: no cover - provided by the deployment
        raise NotImplementedError

    async def ServerLive(
        self, request: pb.ServerLiveRequest, grpc_context: Any = None
    ) -> pb.ServerLiveResponse:
        """Triton's answer; ``live: false`` when it does not answer within the probe timeout."""
        return await self._probe("ServerLive", request, pb.ServerLiveResponse, grpc_context)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, grpc_context: Any = None
    ) -> pb.ServerReadyResponse:
        """Triton's answer; ``ready: false`` when it does not answer within the probe timeout."""
        return await self._probe("ServerReady", request, pb.ServerReadyResponse, grpc_context)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, grpc_context: Any = None
    ) -> pb.ModelReadyResponse:
        """Triton's answer; ``ready: false`` when it does not answer within the probe timeout."""
        return await self._probe("ModelReady", request, pb.ModelReadyResponse, grpc_context)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, grpc_context: Any = None
    ) -> pb.ServerMetadataResponse:
        """This ingress's name and extensions (as over HTTP) and the version of the node's Triton."""
        return pb.ServerMetadataResponse(
            name="ray-triton-shm", version=self._client.info.version, extensions=["binary_tensor_data"]
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, grpc_context: Any = None
    ) -> pb.ModelMetadataResponse:
        """Triton's answer (or its error status)."""
        return await self._answer("ModelMetadata", request, pb.ModelMetadataResponse, grpc_context)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, grpc_context: Any = None
    ) -> pb.ModelConfigResponse:
        """Triton's answer (or its error status)."""
        return await self._answer("ModelConfig", request, pb.ModelConfigResponse, grpc_context)

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

    async def _probe(self, method: str, request: Any, response_cls: Any, grpc_context: Any) -> Any:
        try:
            return await self._call(method, request, response_cls, PROBE_TIMEOUT_S)
        except GrpcAnswerError as e:
            if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # no Triton to ask: not live, not ready
                return response_cls()
            _fail(grpc_context, e)
        except Exception as e:
            _fail(grpc_context, e)

    async def _answer(self, method: str, request: Any, response_cls: Any, grpc_context: Any) -> Any:
        try:
            return await self._call(method, request, response_cls, PROXY_TIMEOUT_S)
        except Exception as e:
            _fail(grpc_context, e)

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


# RPCs of the service that this ingress does not serve: statistics, repository control,
# shared-memory registration (a remote client cannot share the node's memory), trace
# and log settings. Each answers UNIMPLEMENTED (``ModelStreamInfer`` is not routed).
_UNSERVED = (
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
    "TraceSetting",
    "LogSettings",
)


def _unserved(name: str) -> Any:
    async def method(self: Any, request: Any, grpc_context: Any = None) -> Any:
        _fail(grpc_context, GrpcAnswerError("UNIMPLEMENTED", f"{name} is not served by this ingress"))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``: not served here (``UNIMPLEMENTED``)."
    return method


for _name in _UNSERVED:
    setattr(KServeGrpcMixin, _name, _unserved(_name))
