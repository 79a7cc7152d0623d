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
* Every other RPC: :func:`~ray_triton_shm._private.serve.protocol.kserve_grpc_routes.grpc_route`
  (forwarded to the node's Triton over the same channel, answered, or refused
  with a message), as over HTTP.

Errors are gRPC statuses with Triton's code and message for what Triton
refuses, ``INVALID_ARGUMENT`` for malformed requests (as Triton), and never
Ray's internals; segment keys are redacted from every message.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.node import node_config
from ray_triton_shm._private.serve.protocol.grpc_messages import (
    decode_infer_request,
    encode_infer_response,
    status_of,
)
from ray_triton_shm._private.serve.protocol.kserve_grpc_routes import (
    ROUTED,
    SERVICE,
    GrpcAnswerError,
    grpc_route,
)
from ray_triton_shm._private.serve.protocol.kserve_routes import PROXY_TIMEOUT_S, IngressNode
from ray_triton_shm._private.triton.grpc_channel import NEVER_SENT_PREFIX, accepts_connections
from ray_triton_shm.errors import (
    LayoutError,
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


class KServeGrpcMixin:
    """The RPCs of ``inference.GRPCInferenceService`` as Serve deployment methods.

    The class mixing it in has ``self._client`` (a :class:`NodeClient`),
    ``self._node`` (the :class:`~ray_triton_shm._private.serve.protocol.kserve_routes.RouteNode`
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
    method.__doc__ = f"``{name}``: see :mod:`~ray_triton_shm._private.serve.protocol.kserve_grpc_routes`."
    return method


for _name in ROUTED:
    setattr(KServeGrpcMixin, _name, _routed(_name))
