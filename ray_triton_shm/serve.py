"""A Ray Serve application in front of the Triton on each replica's node.

Example Serve config (see ``deployments/*.yaml``)::

    applications:
      - name: triton
        route_prefix: /
        import_path: ray_triton_shm.serve:app
        args:
          model_repository: examples
          pools: {identity: {slots: 4, max_batch_size: 1, max_shapes: {INPUT0: [1048576]}}}

Then ``tritonclient.http.InferenceServerClient("localhost:8000")`` works
against Serve unchanged, and Python code can call the deployment handle::

    handle = serve.get_app_handle("triton")
    outputs = await handle.infer.remote("add_sub", {"INPUT0": a, "INPUT1": b})
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ray_triton_shm._private import kserve, kserve_http
from ray_triton_shm._private.frontdoor import FrontDoor, FrontDoorConfig
from ray_triton_shm._private.kserve_grpc import KServeGrpcMixin, add_kserve_grpc_servicer
from ray_triton_shm._private.kserve_http import request_body as _request_body
from ray_triton_shm._private.node_config import split_app_args
from ray_triton_shm._private.repository import resolve_repositories
from ray_triton_shm._private.segment import redact
from ray_triton_shm._private.slot_ref import SlotRef
from ray_triton_shm._private.slot_ref_serve import SlotRefCaller, SlotRefLease, SlotRefMixin
from ray_triton_shm.errors import RayTritonShmError
from ray_triton_shm.node import NodeClient, NodeConfig

__all__ = [
    "FrontDoorConfig",
    "SlotRef",
    "SlotRefCaller",
    "SlotRefLease",
    "TritonDeployment",
    "add_kserve_grpc_servicer",
    "app",
    "build_node_config",
    "resolve_model_repository",
    "run_config_file",
]

logger = logging.getLogger(__name__)

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
_MODEL = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/config)?$")


def resolve_model_repository(value: str | Sequence[str] | None) -> str | tuple[str, ...]:
    """The model repository (or repositories) as Triton gets them.

    ``examples`` (or nothing) means the example models shipped in the package;
    a relative path is taken from the current directory; ``s3://``, ``gs://``
    and ``as://`` URIs pass through unchanged (Triton reads them itself); a
    list serves several repositories at once.

    Raises:
        ConfigError: A local directory does not exist.
    """
    return resolve_repositories(value)


def build_node_config(
    model_repository: str | Sequence[str] | None = None,
    pools: Mapping[str, Mapping[str, Any]] | None = None,
    default_pool: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    **node_fields: Any,
) -> NodeConfig:
    """A :class:`NodeConfig` from plain values, as found in a Serve config file.

    Same as :meth:`NodeConfig.from_args` (kept for existing callers).

    Args:
        model_repository: Path (or ``examples``).
        pools: Model name -> :class:`PoolConfig` fields.
        default_pool: :class:`PoolConfig` fields for other models.
        server: :class:`ServerConfig` fields.
        **node_fields: Other :class:`NodeConfig` fields (``idle_shutdown_s``,
            ``health_interval_s``, ``quarantine_s``, ``preload``,
            ``request_timeout_s``, ``cuda_pools``); unset ones come from the
            environment, then the defaults.

    Raises:
        ConfigError: A value is invalid or unknown.
    """
    return NodeConfig.from_args(
        model_repository, pools=pools, default_pool=default_pool, server=server, **node_fields
    )


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class TritonDeployment(KServeGrpcMixin, SlotRefMixin):
    """Serve replica: KServe v2 over HTTP and gRPC, numpy over the handle, shm to its node's Triton.

    Handle callers on the replica's node can send slot references instead of
    arrays (``infer_ref``, from :class:`SlotRefMixin`; see :class:`SlotRefCaller`).

    The gRPC methods (``ModelInfer``, ``ServerLive``, ...) come from
    :class:`~ray_triton_shm._private.kserve_grpc.KServeGrpcMixin`; Serve's gRPC
    proxy calls them when ``grpc_options`` names Triton's servicer (see the README).

    Args:
        node_config: What the node actor runs (created if the node has none).
        slots_per_model: At most this many slots of a model used by this replica
            at once (``None``: no cap; slots are shared with every process on the node).
        memory: Slot memory of this replica's pools, ``"system"``, ``"cuda"`` or
            ``"auto"`` (see :class:`NodeClient`). With GPU memory, handle calls
            return cupy arrays (Ray pickles them through host memory and
            rebuilds them on the caller's GPU); HTTP answers are always encoded
            from host copies.
    """

    def __init__(
        self,
        node_config: NodeConfig,
        slots_per_model: int | None = None,
        memory: str = "system",
        frontdoor: FrontDoorConfig | None = None,
    ) -> None:
        # Outputs larger than their slot go over gRPC: the app answers whatever Triton answers.
        self._client = NodeClient(
            node_config, slots_per_model=slots_per_model, memory=memory, kind="serve", grpc_fallback=True
        )
        self._versions: dict[str, tuple[float, str]] = {}  # model -> (expiry, version served)
        self._frontdoor: FrontDoor | None = None
        if frontdoor is not None:
            try:
                self._frontdoor = FrontDoor(frontdoor, self, serve.get_replica_context().app_name)
            except BaseException:
                self._client.close()
                raise
            logger.info(
                "front door on %s: HTTP port %s, gRPC port %s",
                frontdoor.host,
                self._frontdoor.http.port if self._frontdoor.http else None,
                self._frontdoor.grpc.port if self._frontdoor.grpc else None,
            )
        logger.info(
            "replica on node %s uses Triton %s", self._client.info.node_id, self._client.info.grpc_url
        )

    def __del__(self) -> None:
        """Close the front door's listeners (Serve calls this when the replica stops)."""
        door = self.__dict__.get("_frontdoor")
        if door is not None:
            self._frontdoor = None
            door.close()

    async def frontdoor_ports(self) -> dict[str, int | None]:
        """The ports this replica's front door listens on (``None``: that protocol has none)."""
        door = self._frontdoor
        return {
            "http": door.http.port if door is not None and door.http is not None else None,
            "grpc": door.grpc.port if door is not None and door.grpc is not None else None,
        }

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``model`` on numpy ``inputs`` through shared memory (handle API).

        Outputs are read-only. They are views of the slot (pinned until Ray has
        serialised them) rather than copies: Ray copies a replica's return value
        into its object store anyway.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError.
        """
        return dict(await self._client.ainfer(model, inputs, copy=False))

    async def infer_grpc(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The same over plain gRPC, for comparison."""
        return dict(await asyncio.to_thread(self._client.infer_grpc, model, inputs))

    async def infer_with_origin(
        self, model: str, inputs: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """:meth:`infer`, plus where it ran: the path taken and this replica's node and Triton.

        Raises:
            The same errors as :meth:`infer`.
        """
        result = await self._client.ainfer(model, inputs)
        return dict(result), {"path": result.path, **(await self.whereami())}

    async def whereami(self) -> dict[str, Any]:
        """This replica's pid and node (as Ray runs it), the node and Triton it uses, its slots in use."""
        import ray

        info = self._client.info
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "triton_node_id": info.node_id,
            "triton_pid": info.triton_pid,
            "actor_pid": info.actor_pid,
            "grpc_url": info.grpc_url,
            "busy": {stats.model: stats.busy for stats in self._client.client.pool_stats()},
        }

    async def __call__(self, request: Request) -> Response:
        """KServe v2 over HTTP, under whatever ``route_prefix`` the app has (see the README)."""
        path = kserve.route_path(request.scope)
        try:
            if request.method == "POST":
                match = _INFER.match(path)
                if match:
                    model, version = match.group(1), match.group(2)
                    if version is not None:  # Triton honours the version (and any Content-Encoding)
                        header_length = kserve.parse_header_length(request.headers.get(kserve.HEADER_LENGTH))
                        kserve.refuse_shm_parameters(await _request_body(request), header_length)
                        return await self._proxy(request, path, await request.body())
                    return await self._http_infer(model, request)
            elif request.method == "GET":
                if path in ("/v2/health/ready", "/v2/health/live"):
                    return await self._proxy(request, path, None, probe=True)
                if path == "/v2":
                    return await self._server_metadata()
                match = _MODEL.match(path)
                if match:
                    return await self._proxy(request, path, None, probe=match.group(3) == "/ready")
            return _error(404, "Not Found")  # Triton's answer to a path it does not serve
        except Exception as e:  # every failure becomes a KServe error object
            return _error_response(e)

    async def _server_metadata(self) -> Response:
        return JSONResponse(
            {
                "name": "ray-triton-shm",
                "version": self._client.info.version,
                "extensions": ["binary_tensor_data"],
            }
        )

    async def _proxy(
        self, request: Request, path: str, body: bytes | None, *, probe: bool = False
    ) -> Response:
        """Send the request to the node's Triton over loopback HTTP and give back its answer as is.

        Health and readiness (``probe``) answer 400, KServe's "false", when
        Triton does not answer within :data:`PROBE_TIMEOUT_S`; other routes 503.
        """
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        target = kserve.triton_path(path, request.url.query)
        try:
            code, answer, answer_headers = await asyncio.to_thread(
                _triton_http,
                self._client.info.http_url,
                request.method,
                target,
                body,
                headers,
                PROBE_TIMEOUT_S if probe else PROXY_TIMEOUT_S,
            )
        except OSError as e:
            message = f"Triton on this node did not answer: {type(e).__name__}"
            return _error(400 if probe else 503, message)
        if code >= 400:  # Triton's messages can name shm keys; they must not leave the machine
            answer = redact_bytes(answer)
        return Response(answer, status_code=code, headers=answer_headers)

    async def _http_infer(self, model: str, request: Request) -> Response:
        # A binary request goes from Serve's chunks straight into a slot, its answer from the slot
        # straight into the response body (see kserve_http).
        return await kserve_http.http_infer(self._client, model, request, self._served_version)

    async def _served_version(self, model: str) -> str:
        """The version Triton runs for a request without one: its highest ready version (cached briefly)."""
        now = time.monotonic()
        cached = self._versions.get(model)
        if cached is not None and cached[0] > now:
            return cached[1]
        version = "1"
        try:
            code, answer, _ = await asyncio.to_thread(
                _triton_http,
                self._client.info.http_url,
                "GET",
                kserve.triton_path(f"/v2/models/{model}", ""),
                None,
                {},
                PROBE_TIMEOUT_S,
            )
            versions = (json.loads(answer).get("versions") or []) if code == 200 else []
            numbers = [int(v) for v in versions if str(v).isdigit()]
            if numbers:
                version = str(max(numbers))
        except (OSError, ValueError, AttributeError):
            logger.debug("could not read the versions of %s", model, exc_info=True)
        self._versions[model] = (now + _VERSION_TTL_S, version)
        return version


PROBE_TIMEOUT_S = 2.0
"""How long a health or readiness probe waits for the node's Triton before answering "not ready"."""
PROXY_TIMEOUT_S = 60.0
"""How long metadata, config and versioned inference requests wait for the node's Triton."""
_VERSION_TTL_S = 10.0
_FORWARDED_HEADERS = ("content-type", "content-encoding", "accept-encoding", kserve.HEADER_LENGTH)
_ANSWER_HEADERS = ("content-type", "content-encoding", kserve.HEADER_LENGTH)


def _triton_http(
    url: str, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout: float
) -> tuple[int, bytes, dict[str, str]]:
    """One request to Triton's HTTP endpoint at ``host:port``: its status, body and protocol headers.

    Raises:
        OSError: Triton cannot be reached or did not answer in time.
    """
    host, _, port = url.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        answer = conn.getresponse()
        data = answer.read()
        kept = {k.lower(): v for k, v in answer.getheaders() if k.lower() in _ANSWER_HEADERS}
        return answer.status, data, kept
    except http.client.HTTPException as e:
        raise OSError(f"unreadable answer from Triton: {e}") from e
    finally:
        conn.close()


def redact_bytes(data: bytes) -> bytes:
    """``data`` with segment keys redacted when it is text (Triton's error messages can name them)."""
    if b"rtshm_" not in data:
        return data
    try:
        return redact(data.decode()).encode()
    except UnicodeDecodeError:
        return data


def _error(code: int, message: str) -> Response:
    return Response(kserve.error_body(redact(message)), status_code=code, media_type="application/json")


def _error_response(error: Exception) -> Response:
    """The KServe error answer for ``error``; never Ray's task header or a traceback."""
    cause = error
    while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, Exception):
        cause = cause.cause
    if isinstance(cause, RayTritonShmError):
        return _error(kserve.http_status(cause), kserve.error_message(cause))
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
        logger.warning("node actor unavailable: %s", type(cause).__name__)
        return _error(503, "the Triton node actor on this node is unavailable")
    logger.exception("unexpected error in the KServe ingress")
    return _error(500, f"internal error ({type(cause).__name__})")


def _build(args: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> serve.Application:
    rest = dict(args or {})
    frontdoor = FrontDoorConfig.from_args(rest.pop("frontdoor", None))
    node_config, client = split_app_args(rest)
    deployment = TritonDeployment.options(**dict(options)) if options else TritonDeployment
    return deployment.bind(node_config, client["slots_per_model"], client["memory"], frontdoor)


def run_config_file(path: str, *, blocking: bool = False) -> dict[str, Any]:
    """Deploy every application of a Serve config file (as ``serve run`` would).

    Each application's ``import_path`` must point at this module's ``app``;
    per-deployment options (``num_replicas``, ``ray_actor_options``, ...), ``proxy_location``,
    ``http_options`` (host, port) and ``grpc_options`` are applied.

    Returns:
        Deployment handles by application name.

    Raises:
        RayTritonShmError: The file names another import path.
    """
    import yaml

    with open(path) as f:
        spec = yaml.safe_load(f)
    http = spec.get("http_options") or {}
    start: dict[str, Any] = {}
    if http:
        start["http_options"] = {k: v for k, v in http.items() if k in ("host", "port")}
    if spec.get("proxy_location"):
        start["proxy_location"] = spec["proxy_location"]
    if spec.get("grpc_options"):
        start["grpc_options"] = dict(spec["grpc_options"])
    if start:
        serve.start(**start)
    handles = {}
    for application in spec["applications"]:
        if application["import_path"] != "ray_triton_shm.serve:app":
            raise RayTritonShmError(f"{path}: unsupported import_path {application['import_path']!r}")
        options = {}
        for deployment in application.get("deployments") or []:
            options.update({k: v for k, v in deployment.items() if k != "name"})
        handles[application["name"]] = serve.run(
            _build(application.get("args") or {}, options),
            name=application["name"],
            route_prefix=application.get("route_prefix", "/"),
            blocking=blocking,
        )
    return handles


def app(args: Mapping[str, Any]) -> serve.Application:
    """Application builder for Serve config files (``import_path: ray_triton_shm.serve:app``).

    Args:
        args: ``model_repository`` (path or ``examples``), ``pools`` (model ->
            PoolConfig fields), ``default_pool``, ``server`` (ServerConfig
            fields), ``slots_per_model``, ``memory`` (slot memory of the
            replicas: system, cuda or auto), and the node settings
            ``idle_shutdown_s``, ``health_interval_s``, ``quarantine_s``,
            ``preload``, ``request_timeout_s``, ``cuda_pools`` (see
            :class:`NodeConfig`; lease timeouts are pool fields), and
            ``frontdoor`` (host, http_port, grpc_port: the replicas' own
            KServe v2 listeners, see :class:`FrontDoorConfig`).

    Returns:
        The bound application.

    Raises:
        ConfigError / RayTritonShmError: Invalid arguments.
    """
    return _build(args)
