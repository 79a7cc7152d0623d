"""Every RPC of Triton's ``inference.GRPCInferenceService`` but inference, in one transport-neutral place.

:func:`grpc_route` takes the RPC's name and its request message and returns
the response message, or raises :class:`GrpcAnswerError` (or a
:class:`RefusedError`) that the listener answers as a gRPC status. The same
choices as over HTTP (:mod:`~ray_triton_shm._private.serve.protocol.kserve_routes`):

* Forwarded to the node's Triton (through ``forward``, the listener's
  channel): ``ServerLive``, ``ServerReady``, ``ModelReady`` (``false`` when
  Triton does not answer in time), ``ModelMetadata``, ``ModelConfig``,
  ``ModelStatistics``, ``RepositoryIndex``, and ``LogSettings`` /
  ``TraceSetting`` without settings (a read).
* Answered here: ``ServerMetadata`` (``triton``, Triton's version, the
  extensions served); ``SystemSharedMemoryStatus`` / ``CudaSharedMemoryStatus``
  for the caller (no regions: ``NOT_FOUND`` for a named one, as Triton);
  their ``Unregister`` a no-op.
* ``RepositoryModelLoad`` / ``Unload``: forwarded with explicit model control,
  else ``UNAVAILABLE`` (:class:`ModelControlRefusedError`); a load that sends
  model files (``file:<path>`` parameters) ``UNIMPLEMENTED``.
* Refused (``UNIMPLEMENTED`` with a message that says why and what to use
  instead): shared-memory registration, log or trace settings changes, and
  ``ModelStreamInfer``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.protocol.kserve_routes import (
    CONTROL_TIMEOUT_S,
    FILE_PARAMETER_PREFIX,
    PROBE_TIMEOUT_S,
    PROXY_TIMEOUT_S,
    SERVER_NAME,
    RouteNode,
    extensions,
    model_control_refused,
    model_files_refused,
    settings_refused,
    shm_region_not_found,
    shm_registration_refused,
)
from ray_triton_shm.errors import RayTritonShmError, RefusedError

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"


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


Forward = Callable[[str, Any, Any, float], Awaitable[Any]]
"""``forward(method, request, response_cls, timeout)``: the RPC on the node's Triton.

Returns Triton's response; raises :class:`GrpcAnswerError` with Triton's status
(or ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` when it cannot be reached in time)."""


async def grpc_route(node: RouteNode, method: str, request: Any, forward: Forward) -> Any:
    """The response of RPC ``method`` (any but ``ModelInfer``) for ``request``.

    Raises:
        GrpcAnswerError: Triton's error status, or ``UNIMPLEMENTED`` for an RPC not in the service.
        RefusedError: What the ingress does not do (see the module docstring).
    """
    handler = _HANDLERS.get(method)
    if handler is None:
        raise GrpcAnswerError("UNIMPLEMENTED", f"{method} is not a method of {SERVICE}")
    return await handler(node, request, forward)


def _forwarded(method: str, response_cls: Any) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        return await forward(method, request, response_cls, PROXY_TIMEOUT_S)

    return handler


def _probe(method: str, response_cls: Any) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        try:
            return await forward(method, request, response_cls, PROBE_TIMEOUT_S)
        except GrpcAnswerError as e:
            if e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):  # no Triton to ask: not live, not ready
                return response_cls()
            raise

    return handler


async def _server_metadata(node: RouteNode, request: Any, forward: Forward) -> Any:
    return pb.ServerMetadataResponse(
        name=SERVER_NAME,
        version=node.info.version,
        extensions=extensions(node.explicit_model_control),
    )


def _repository_control(method: str, response_cls: Any, action: str) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        if not node.explicit_model_control:
            raise model_control_refused(action, request.model_name)
        if action == "load" and any(key.startswith(FILE_PARAMETER_PREFIX) for key in request.parameters):
            raise model_files_refused(request.model_name)
        response = await forward(method, request, response_cls, CONTROL_TIMEOUT_S)
        try:
            await node.model_changed(request.model_name)
        except Exception:  # Triton did it; the node catches up when a client finds the layout changed
            logger.warning(
                "the node could not re-read the configuration of %s", request.model_name, exc_info=True
            )
        return response

    return handler


def _shm_status(kind: str, response_cls: Any) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        if request.name:
            raise GrpcAnswerError(*shm_region_not_found(kind, request.name))
        return response_cls()

    return handler


def _shm_unregister(response_cls: Any) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        return response_cls()

    return handler


def _shm_register(kind: str) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        raise shm_registration_refused(kind)

    return handler


def _settings(method: str, response_cls: Any, what: str) -> Callable[..., Awaitable[Any]]:
    async def handler(node: RouteNode, request: Any, forward: Forward) -> Any:
        if len(request.settings):
            raise settings_refused(what)
        return await forward(method, request, response_cls, PROXY_TIMEOUT_S)

    return handler


STREAM_REFUSED = (
    "ModelStreamInfer is not supported by this endpoint: streaming (decoupled or sequence) "
    "inference is not served by the ingress. Use ModelInfer (tritonclient's infer or async_infer)"
)
"""Why ``ModelStreamInfer`` is refused (``UNIMPLEMENTED``), on every gRPC listener."""


async def _stream_infer(node: RouteNode, request: Any, forward: Forward) -> Any:
    raise RefusedError(STREAM_REFUSED)


_HANDLERS: dict[str, Callable[..., Awaitable[Any]]] = {
    "ServerLive": _probe("ServerLive", pb.ServerLiveResponse),
    "ServerReady": _probe("ServerReady", pb.ServerReadyResponse),
    "ModelReady": _probe("ModelReady", pb.ModelReadyResponse),
    "ServerMetadata": _server_metadata,
    "ModelMetadata": _forwarded("ModelMetadata", pb.ModelMetadataResponse),
    "ModelConfig": _forwarded("ModelConfig", pb.ModelConfigResponse),
    "ModelStatistics": _forwarded("ModelStatistics", pb.ModelStatisticsResponse),
    "RepositoryIndex": _forwarded("RepositoryIndex", pb.RepositoryIndexResponse),
    "RepositoryModelLoad": _repository_control("RepositoryModelLoad", pb.RepositoryModelLoadResponse, "load"),
    "RepositoryModelUnload": _repository_control(
        "RepositoryModelUnload", pb.RepositoryModelUnloadResponse, "unload"
    ),
    "SystemSharedMemoryStatus": _shm_status("system", pb.SystemSharedMemoryStatusResponse),
    "SystemSharedMemoryRegister": _shm_register("system"),
    "SystemSharedMemoryUnregister": _shm_unregister(pb.SystemSharedMemoryUnregisterResponse),
    "CudaSharedMemoryStatus": _shm_status("cuda", pb.CudaSharedMemoryStatusResponse),
    "CudaSharedMemoryRegister": _shm_register("cuda"),
    "CudaSharedMemoryUnregister": _shm_unregister(pb.CudaSharedMemoryUnregisterResponse),
    "LogSettings": _settings("LogSettings", pb.LogSettingsResponse, "log"),
    "TraceSetting": _settings("TraceSetting", pb.TraceSettingResponse, "trace"),
    "ModelStreamInfer": _stream_infer,
}

ROUTED = tuple(_HANDLERS)
"""The RPCs :func:`grpc_route` answers (every one of the service but ``ModelInfer``)."""
