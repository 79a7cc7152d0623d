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
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ray_triton_shm._private import kserve
from ray_triton_shm._private.cuda import to_host
from ray_triton_shm._private.repository import resolve_repositories
from ray_triton_shm._private.segment import redact
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    PoolTimeoutError,
    RayTritonShmError,
    TritonCallError,
)
from ray_triton_shm.node import NodeClient, NodeConfig

__all__ = ["TritonDeployment", "app", "build_node_config", "resolve_model_repository", "run_config_file"]

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
    quarantine_s: float = 30.0,
    server: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """A :class:`NodeConfig` from plain values, as found in a Serve config file.

    Raises:
        ConfigError: A value is invalid.
    """
    server_fields = dict(server or {})
    server_fields["model_repository"] = resolve_model_repository(model_repository)
    return NodeConfig(
        server=ServerConfig(**server_fields),
        pools={name: PoolConfig(**dict(fields)) for name, fields in (pools or {}).items()},
        default_pool=PoolConfig(**dict(default_pool or {})),
        quarantine_s=quarantine_s,
    )


def _status_for(error: Exception) -> int:
    if isinstance(error, (InputError, LayoutError)):
        return 400
    if isinstance(error, TritonCallError) and error.status in ("NOT_FOUND",):
        return 404
    if isinstance(error, TritonCallError) and error.status in ("INVALID_ARGUMENT",):
        return 400
    if isinstance(error, PoolTimeoutError):
        return 503
    return 500


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class TritonDeployment:
    """Serve replica: KServe v2 over HTTP, numpy over the handle, shm to its node's Triton.

    Args:
        node_config: What the node actor runs (created if the node has none).
        slots_per_model: Slots this replica asks its node actor for, per model.
        memory: Slot memory of this replica's pools, ``"system"``, ``"cuda"`` or
            ``"auto"`` (see :class:`NodeClient`). With GPU memory, handle calls
            return cupy arrays (Ray pickles them through host memory and
            rebuilds them on the caller's GPU); HTTP answers are always encoded
            from host copies.
    """

    def __init__(self, node_config: NodeConfig, slots_per_model: int = 2, memory: str = "system") -> None:
        self._client = NodeClient(node_config, slots_per_model=slots_per_model, memory=memory)
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
        """This replica's pid, node and Triton (for tests and ``status``)."""
        info = self._client.info
        return {
            "pid": os.getpid(),
            "node_id": info.node_id,
            "triton_pid": info.triton_pid,
            "grpc_url": info.grpc_url,
        }

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/") or "/"
        try:
            if request.method == "POST":
                match = _INFER.match(path)
                if match:
                    return await self._http_infer(match.group(1), request)
            elif request.method == "GET":
                return await self._http_get(path)
            return JSONResponse({"error": f"no route for {request.method} {path}"}, status_code=404)
        except RayTritonShmError as e:
            # Triton's messages can name shm keys; they must not leave the machine.
            return Response(
                kserve.error_body(redact(str(e))), status_code=_status_for(e), media_type="application/json"
            )

    async def _http_get(self, path: str) -> Response:
        if path in ("/v2/health/ready", "/v2/health/live"):
            return Response(status_code=200)
        if path == "/v2":
            return JSONResponse(
                {
                    "name": "ray-triton-shm",
                    "version": self._client.info.version,
                    "extensions": ["binary_tensor_data"],
                }
            )
        match = _MODEL.match(path)
        if not match:
            return JSONResponse({"error": f"no route for GET {path}"}, status_code=404)
        model, suffix = match.group(1), match.group(3)
        if suffix == "/config":
            return JSONResponse(await asyncio.to_thread(self._client.model_config, model))
        metadata = await asyncio.to_thread(self._client.model_metadata, model)
        if suffix == "/ready":
            return Response(status_code=200)
        return JSONResponse(metadata)

    async def _http_infer(self, model: str, request: Request) -> Response:
        body = await request.body()
        header = request.headers.get(kserve.HEADER_LENGTH)
        decoded = kserve.decode_request(body, int(header) if header else None)
        # Encoding the answer copies the outputs: read them straight from the slot.
        outputs = await self._client.ainfer(model, decoded.inputs, outputs=decoded.outputs, copy=False)
        host = {name: to_host(value) for name, value in outputs.items()}
        payload, headers = kserve.encode_response(model, decoded, host)
        return Response(payload, headers=headers)


def _build(args: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> serve.Application:
    args = dict(args or {})
    slots = int(args.pop("slots_per_model", 2))
    memory = str(args.pop("memory", "system"))
    node_config = build_node_config(**args)
    deployment = TritonDeployment.options(**dict(options)) if options else TritonDeployment
    return deployment.bind(node_config, slots, memory)


def run_config_file(path: str, *, blocking: bool = False) -> dict[str, Any]:
    """Deploy every application of a Serve config file (as ``serve run`` would).

    Each application's ``import_path`` must point at this module's ``app``;
    per-deployment options (``num_replicas``, ...) are applied.

    Returns:
        Deployment handles by application name.

    Raises:
        RayTritonShmError: The file names another import path.
    """
    import yaml

    with open(path) as f:
        spec = yaml.safe_load(f)
    http = spec.get("http_options") or {}
    if http:
        serve.start(http_options={k: v for k, v in http.items() if k in ("host", "port")})
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
            fields), ``quarantine_s``, ``slots_per_model``, ``memory`` (slot
            memory of the replicas: system, cuda or auto).

    Returns:
        The bound application.

    Raises:
        ConfigError / RayTritonShmError: Invalid arguments.
    """
    return _build(args)
