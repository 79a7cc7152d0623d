"""The front door's gRPC half: Triton's ``inference.GRPCInferenceService`` served by the replica itself.

A ``grpc`` server (a thread pool; ``SO_REUSEPORT``, as gRPC sets it by
default, so every replica of the app on a node shares the port) with a generic
handler:

* ``ModelInfer`` takes the request's bytes as they came: the raw input contents
  are never parsed into a message (:func:`split_infer_request` leaves them as
  views of those bytes); each is copied once, into the slot. The answer is
  the response message's small fields followed by the outputs' bytes, copied
  once from the slot (:func:`encode_infer_response_bytes`).
* Every other RPC is the Serve ingress's own method (of
  :class:`~ray_triton_shm._private.serve.kserve_grpc.KServeGrpcMixin`), run on the
  front door's event loop, so both ingresses answer alike.

A request whose ``application`` metadata names another app is refused
(``NOT_FOUND``): each app's front door has ports of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.kserve import serialize_bytes
from ray_triton_shm._private.serve.kserve_grpc import (
    SERVICE,
    GrpcAnswerError,
    decode_infer_request,
    status_of,
)
from ray_triton_shm._private.serve.kserve_grpc_routes import STREAM_REFUSED
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON
from ray_triton_shm.errors import FrontDoorError, InputError, LayoutError

logger = logging.getLogger(__name__)

_RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_KEY = bytes([(6 << 3) | 2])  # ModelInferResponse.raw_output_contents, length-delimited
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 1),
]


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise InputError("the ModelInferRequest message is malformed (a varint runs past its end)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_infer_request(data: bytes) -> tuple[pb.ModelInferRequest, list[memoryview]]:
    """The request without its raw input contents, and those contents as views of ``data``.

    Raises:
        InputError: ``data`` is not a well-formed message.
    """
    view = memoryview(data)
    kept: list[tuple[int, int]] = []
    raw: list[memoryview] = []
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(view, pos)
            end = pos + length
            if end > len(view):
                raise InputError("the ModelInferRequest message is malformed (a field runs past its end)")
            if field == _RAW_INPUT_FIELD:
                raw.append(view[pos:end])
                pos = end
                continue
            pos = end
        elif wire == 0:
            _, pos = _varint(view, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise InputError(f"the ModelInferRequest message is malformed (wire type {wire})")
        if kept and kept[-1][1] == start:
            kept[-1] = (kept[-1][0], pos)
        else:
            kept.append((start, pos))
    if pos > len(view):
        raise InputError("the ModelInferRequest message is malformed (it ends inside a field)")
    rest = b"".join(view[a:b] for a, b in kept)
    try:
        return pb.ModelInferRequest.FromString(rest), raw
    except Exception as e:  # protobuf's DecodeError
        raise InputError(f"the ModelInferRequest message is malformed: {e}") from e


def encode_infer_response_bytes(
    model: str, version: str, request_id: str, outputs: Mapping[str, Any]
) -> bytes:
    """A serialised ``ModelInferResponse`` of ``outputs`` (raw contents), each output copied once."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    blobs: list[bytes | memoryview] = []
    for name, value in outputs.items():
        array = np.ascontiguousarray(to_host(value))
        is_bytes = array.dtype == object
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES" if is_bytes else NUMPY_TO_TRITON[array.dtype]
        tensor.shape.extend(int(d) for d in array.shape)
        blob = serialize_bytes(array) if is_bytes else memoryview(array.reshape(-1).view(np.uint8))
        blobs.extend((_RAW_OUTPUT_KEY, encode_varint(len(blob)), blob))
    return b"".join([response.SerializeToString(), *blobs])


class GrpcDoor:
    """The gRPC server of one replica's front door.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        client: The replica's :class:`NodeClient`.
        servicer: The object whose ``KServeGrpcMixin`` methods answer the other RPCs.
        served_version: The version Triton runs for a request without one.
        run: Runs a coroutine on the front door's event loop and returns its result.
        app_name: This app's name (checked against the ``application`` metadata).
        threads: Requests served at once.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client: Any,
        servicer: Any,
        served_version: Callable[[str], str],
        run: Callable[[Any], Any],
        app_name: str,
        threads: int,
    ) -> None:
        self._client = client
        self._servicer = servicer
        self._served_version = served_version
        self._run = run
        self.app_name = app_name
        self._server = grpc.server(
            ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc"),
            handlers=[_Handlers(self)],
            options=_SERVER_OPTIONS,
            maximum_concurrent_rpcs=None,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as e:
            raise FrontDoorError(f"cannot listen for gRPC on {address}: {e}") from e
        if not bound:
            raise FrontDoorError(f"cannot listen for gRPC on {address}")
        self.host = host
        self.port = bound
        self._server.start()

    def close(self, grace_s: float = 1.0) -> None:
        """Stop the server; returns when it no longer listens."""
        self._server.stop(grace_s).wait(grace_s + 5)

    # -- RPCs ---------------------------------------------------------------
    def check_application(self, context: grpc.ServicerContext) -> None:
        """Refuse (``NOT_FOUND``) a request whose ``application`` metadata names another app."""
        for key, value in context.invocation_metadata() or ():
            if key == "application" and value != self.app_name:
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"application {value!r} is not served on this port: it is application"
                    f" {self.app_name!r}'s front door (each application has ports of its own)",
                )

    def infer_bytes(self, data: bytes) -> bytes:
        """The serialised answer to a serialised ``ModelInferRequest``.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError, GrpcAnswerError.
        """
        request, raw = split_infer_request(data)
        inputs, outputs = decode_infer_request(request, raw)
        if not request.model_version:
            try:
                result = self._client.infer(request.model_name, inputs, outputs=outputs, copy=False)
            except LayoutError:  # tensors that cannot live in slots: Triton's own answer
                result = None
            if result is not None:
                version = self._served_version(request.model_name)
                return encode_infer_response_bytes(request.model_name, version, request.id, result)
        # A version asked for (Triton honours it) or no slots: the ingress's own path.
        del inputs
        full = pb.ModelInferRequest.FromString(data)
        return self._run(self._servicer.ModelInfer(full, None)).SerializeToString()

    def model_infer(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        self.check_application(context)
        try:
            return self.infer_bytes(data)
        except Exception as e:
            self._abort(context, e)
            raise  # not reached: abort raises

    def other(self, name: str, request: Any, context: grpc.ServicerContext) -> Any:
        self.check_application(context)
        try:
            return self._run(getattr(self._servicer, name)(request, None))
        except Exception as e:
            self._abort(context, e)
            raise

    @staticmethod
    def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
        code, message = status_of(error)
        if code == "INTERNAL" and not isinstance(error, GrpcAnswerError):
            logger.warning("front door gRPC: %s", message, exc_info=error)
        context.abort(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), message)


class _Handlers(grpc.GenericRpcHandler):
    """Routes the service's methods: ``ModelInfer`` on raw bytes, the rest as messages."""

    def __init__(self, door: GrpcDoor) -> None:
        self._door = door
        self._prefix = f"/{SERVICE}/"
        self._infer = grpc.unary_unary_rpc_method_handler(door.model_infer)
        self._stream = grpc.stream_stream_rpc_method_handler(_refuse_stream)
        self._others: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(self._prefix):
            return None
        name = method[len(self._prefix) :]
        if name == "ModelInfer":
            return self._infer
        if name == "ModelStreamInfer":
            return self._stream
        handler = self._others.get(name)
        if handler is None:
            request_cls = getattr(pb, f"{name}Request", None)
            response_cls = getattr(pb, f"{name}Response", None)
            if request_cls is None or response_cls is None:
                return None  # gRPC answers UNIMPLEMENTED
            handler = self._others[name] = grpc.unary_unary_rpc_method_handler(
                functools.partial(self._door.other, name),
                request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString,
            )
        return handler


def _refuse_stream(requests: Any, context: grpc.ServicerContext) -> Any:
    """``ModelStreamInfer``: refused with the reason, as by the Serve ingress."""
    context.abort(grpc.StatusCode.UNIMPLEMENTED, STREAM_REFUSED)
    yield  # a generator: gRPC's stream-stream handlers return an iterator


def run_on(loop: asyncio.AbstractEventLoop) -> Callable[[Any], Any]:
    """A function that runs a coroutine on ``loop`` (another thread's) and returns its result."""

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    return run
