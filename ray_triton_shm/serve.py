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
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import yaml
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ray_triton_shm._private.node.node_config import split_app_args
from ray_triton_shm._private.serve.autoscaling import FRONTDOOR_ONGOING as FRONTDOOR_ONGOING
from ray_triton_shm._private.serve.autoscaling import FRONTDOOR_POLICY as FRONTDOOR_POLICY
from ray_triton_shm._private.serve.autoscaling import frontdoor_autoscaling_policy, with_frontdoor_policy
from ray_triton_shm._private.serve.door.batched_observer import BatchedObserver
from ray_triton_shm._private.serve.door.frontdoor import FrontDoor
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.frontdoor_observe import FrontDoorObserver
from ray_triton_shm._private.serve.frontdoor_replica import STATUS_TIMEOUT_S, FrontDoorMixin
from ray_triton_shm._private.serve.ingress import kserve_http
from ray_triton_shm._private.serve.ingress.kserve_grpc import KServeGrpcMixin, add_kserve_grpc_servicer
from ray_triton_shm._private.serve.protocol import kserve, kserve_errors, kserve_limits, kserve_routes
from ray_triton_shm._private.serve.replica_context import drain_budget, max_ongoing_requests
from ray_triton_shm._private.serve.replica_log import log_through_serve
from ray_triton_shm._private.serve.slot_ref import SlotRef
from ray_triton_shm._private.serve.slot_ref_serve import SlotRefCaller, SlotRefLease, SlotRefMixin
from ray_triton_shm._private.triton.repository import resolve_repositories
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
    "build_app",
    "build_node_config",
    "frontdoor_autoscaling_policy",
    "resolve_model_repository",
    "run_config_file",
]

logger = logging.getLogger(__name__)


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
class TritonDeployment(KServeGrpcMixin, SlotRefMixin, FrontDoorMixin):
    """Serve replica: KServe v2 over HTTP and gRPC, numpy over the handle, shm to its node's Triton.

    Handle callers on the replica's node can send slot references instead of
    arrays (``infer_ref``, from :class:`SlotRefMixin`; see :class:`SlotRefCaller`).

    The gRPC methods (``ModelInfer``, ``ServerLive``, ...) come from
    :class:`~ray_triton_shm._private.serve.ingress.kserve_grpc.KServeGrpcMixin`; Serve's gRPC
    proxy calls them when ``grpc_options`` names Triton's servicer (see docs/serve.md).
    What runs with the app's front door (Serve's health check and autoscaling
    stats, reports to the node actor, the drain when the replica stops) comes from
    :class:`~ray_triton_shm._private.serve.frontdoor_replica.FrontDoorMixin`.

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
        log_through_serve()  # the library's lines in the replica's log, as Serve's own
        # Outputs larger than their slot go over gRPC: the app answers whatever Triton answers.
        self._client = NodeClient(
            node_config, slots_per_model=slots_per_model, memory=memory, kind="serve", grpc_fallback=True
        )
        # the version served of known models
        self._versions = kserve_limits.VersionCache(ttl_s=_VERSION_TTL_S)
        self._max_request_bytes = node_config.max_request_bytes
        self._node = kserve_routes.IngressNode(
            self._client, node_config.server.explicit_model_control, node_config.max_request_bytes
        )
        self._frontdoor: FrontDoor | None = None
        self._reported = 0.0
        self._app_name = ""
        if frontdoor is not None:
            context = serve.get_replica_context()
            self._app_name = context.app_name
            self._observer = FrontDoorObserver(context)
            self._recorder = BatchedObserver(self._observer)
            try:
                self._frontdoor = FrontDoor(
                    frontdoor,
                    self,
                    context.app_name,
                    max_ongoing=max_ongoing_requests(context),
                    observer=self._recorder,
                )
            except BaseException:
                self._recorder.close()
                self._client.close()
                raise
            for port in self._fixed_ports():  # kept open by the node actor between replicas
                self._client.hold_door(port, self._app_name, frontdoor.host, frontdoor.port_linger_s)
            self._report_door()
            drain_s = drain_budget(context, frontdoor.drain_timeout_s, STATUS_TIMEOUT_S)
            if drain_s < frontdoor.drain_timeout_s:
                logger.warning(
                    "front door: the deployment's graceful_shutdown_timeout_s leaves its drain %g s, "
                    "not frontdoor.drain_timeout_s (%g s): raise graceful_shutdown_timeout_s to give "
                    "calls in flight their whole drain when the replica stops",
                    drain_s,
                    frontdoor.drain_timeout_s,
                )
            logger.info(
                "front door on %s: HTTP port %s, gRPC port %s",
                frontdoor.host,
                self._frontdoor.http.port if self._frontdoor.http else None,
                self._frontdoor.grpc.port if self._frontdoor.grpc else None,
            )
        logger.info(
            "replica on node %s uses Triton %s", self._client.info.node_id, self._client.info.grpc_url
        )

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
        """This replica's pid and node (as Ray runs it), the node and Triton it uses (its pid and
        gRPC and HTTP endpoints), its slots in use."""
        info = self._client.info
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "triton_node_id": info.node_id,
            "triton_pid": info.triton_pid,
            "actor_pid": info.actor_pid,
            "grpc_url": info.grpc_url,
            "http_url": info.http_url,
            "busy": {stats.model: stats.busy for stats in self._client.client.pool_stats()},
        }

    async def __call__(self, request: Request) -> Response:
        """KServe v2 over HTTP, under whatever ``route_prefix`` the app has (see docs/serve.md).

        Slot inference is answered here; every other route by
        :func:`~ray_triton_shm._private.serve.protocol.kserve_routes.http_route`.
        """
        path = kserve.route_path(request.scope)
        try:
            model = kserve_routes.infer_route(request.method, path)
            if model is not None:
                return await self._http_infer(model, request)
            body = None
            if request.method not in ("GET", "HEAD"):
                body = b"".join(await kserve_http.read_raw_body(request, self._max_request_bytes))
            answer = await kserve_routes.http_route(
                self._node, request.method, path, request.url.query, request.headers, body
            )
            return Response(answer.body, status_code=answer.status, headers=dict(answer.headers))
        except Exception as e:  # every failure becomes a KServe error object
            return _error_response(e)

    async def _http_infer(self, model: str, request: Request) -> Response:
        # A binary request goes from Serve's chunks straight into a slot, its answer from the slot
        # straight into the response body (see kserve_http).
        return await kserve_http.http_infer(
            self._client, model, request, self._served_version, max_bytes=self._max_request_bytes
        )

    async def _served_version(self, model: str) -> str:
        """The version Triton runs for a request without one: its highest ready version.

        Cached briefly for models Triton knows
        (see :class:`~ray_triton_shm._private.serve.protocol.kserve_limits.VersionCache`).
        """
        now = time.monotonic()
        cached = self._versions.get(model, now)
        if cached is not None:
            return cached
        version = "1"
        try:
            code, answer, _ = await asyncio.to_thread(
                kserve_routes.triton_http,
                self._client.info.http_url,
                "GET",
                kserve.triton_path(f"/v2/models/{model}", ""),
                None,
                {},
                PROBE_TIMEOUT_S,
            )
            if code != 200:  # an unknown model (Triton answers its own error): nothing to keep
                return version
            versions = json.loads(answer).get("versions") or []
            numbers = [int(v) for v in versions if str(v).isdigit()]
            if numbers:
                version = str(max(numbers))
        except (OSError, ValueError, AttributeError):
            logger.debug("could not read the versions of %s", model, exc_info=True)
            return version
        self._versions.put(model, version, now)
        return version


PROBE_TIMEOUT_S = kserve_routes.PROBE_TIMEOUT_S
"""How long a health or readiness probe waits for the node's Triton before answering "not ready"."""
_VERSION_TTL_S = 10.0


def _error_response(error: Exception) -> Response:
    """The KServe error answer for ``error``; never Ray's task header or a traceback."""
    status, body = kserve_errors.error_answer(error)
    return Response(body, status_code=status, media_type="application/json")


def build_app(args: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> serve.Application:
    """The application of :func:`app`, its deployment given Serve ``options`` (``num_replicas``, ...).

    An autoscaled deployment (``num_replicas: auto`` or an ``autoscaling_config``
    given as a mapping) of an app with a front door gets
    :func:`frontdoor_autoscaling_policy` unless its config names a policy, so
    that its front door's calls count.

    Raises:
        ConfigError: Invalid ``args``.
    """
    rest = dict(args or {})
    frontdoor = FrontDoorConfig.from_args(rest.pop("frontdoor", None))
    node_config, client = split_app_args(rest)
    if options and frontdoor is not None:
        options = with_frontdoor_policy(options)
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
            build_app(application.get("args") or {}, options),
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
    return build_app(args)
