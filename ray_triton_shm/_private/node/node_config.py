"""The node layer's configuration and identity: what a node actor runs and how clients reach it.

Example:
    >>> from ray_triton_shm.node import NodeConfig
    >>> config = NodeConfig.for_repository("deployments/models", preload=("add_sub",))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.triton.repository import resolve_repositories
from ray_triton_shm.config import PoolConfig, ServerConfig, env_field
from ray_triton_shm.errors import ConfigError

MAX_REQUEST_BYTES = 1 << 26
"""Default largest request body (and inflated body) the ingress accepts: Triton's own HTTP default."""

NAMESPACE = "ray_triton_shm"
NAME_PREFIX = "triton-node-"
CVD = "CUDA_VISIBLE_DEVICES"


def _optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none", "off") else float(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# Settings that only the clients use: they do not change what a node's Triton runs.
_CLIENT_ONLY = ("request_timeout_s", "max_request_bytes")
_CLIENT_ONLY_POOL = ("lease_timeout_s", "min_shm_bytes")


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """What each node actor runs.

    Attributes:
        server: How to start the node's Triton.
        pools: Pool settings by model; other models use ``default_pool``.
        default_pool: Pool settings for models not in ``pools``.
        preload: Models whose pools are created when the actor starts.
        quarantine_s: How long a slot is held back past the deadline of a
            request that may still run on the server (its client timed out,
            or died mid-request): a slot whose client died with a request on
            the server comes back no sooner than that request's deadline
            (the client's ``request_timeout_s``) plus this. Must be > 0.
        health_interval_s: How often Triton's health and client liveness are checked.
        idle_shutdown_s: Once the last user (a ``NodeClient``: Serve replica,
            Data worker, task) is gone for this long, the node actor stops its
            Triton, removes its segments and exits. ``None`` keeps it until
            :func:`~ray_triton_shm.node.shutdown_node_actors`.
        request_timeout_s: Deadline of one inference call of the clients
            (``None``: no deadline); client-side only.
        max_request_bytes: Largest KServe v2 request body the Serve ingress
            reads, and largest it inflates a compressed one to; larger ones
            are answered 413 (a ``Content-Length`` past it before any of the
            body is read). 64 MiB by default, as Triton's own HTTP endpoint
            (``--http-max-input-size``). Client-side only. Env
            ``RAY_TRITON_SHM_MAX_REQUEST_BYTES``.
        cuda_pools: When clients that ask for GPU memory get CUDA pools:
            ``"auto"`` for models whose instances run on GPU (or whose pool
            config says ``memory="cuda"``) on nodes with GPUs, ``"always"``
            for every model on nodes with GPUs, ``"never"``. Others get
            system-memory pools.
        unhealthy_after_s: How long Triton may fail its readiness probe (live
            and ready over HTTP) before it is killed and restarted; a dead
            Triton is restarted at once. Env ``RAY_TRITON_SHM_UNHEALTHY_AFTER_S``.
        restart_backoff_s: Wait before the second restart in a row; it doubles
            for each further one. Env ``RAY_TRITON_SHM_RESTART_BACKOFF_S``.
        restart_backoff_max_s: Longest wait between restarts; a Triton that
            stays ready this long after a restart ends the streak. Env
            ``RAY_TRITON_SHM_RESTART_BACKOFF_MAX_S``.
    """

    server: ServerConfig
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)
    default_pool: PoolConfig = field(default_factory=PoolConfig)
    preload: tuple[str, ...] = env_field("PRELOAD", (), _names)
    quarantine_s: float = env_field("QUARANTINE_S", 30.0)
    health_interval_s: float = env_field("HEALTH_INTERVAL_S", 0.5)
    cuda_pools: str = env_field("CUDA_POOLS", "auto")
    idle_shutdown_s: float | None = env_field("IDLE_SHUTDOWN_S", 30.0, _optional_float)
    request_timeout_s: float | None = env_field("REQUEST_TIMEOUT_S", 60.0, _optional_float)
    max_request_bytes: int = env_field("MAX_REQUEST_BYTES", MAX_REQUEST_BYTES)
    unhealthy_after_s: float = env_field("UNHEALTHY_AFTER_S", 15.0)
    restart_backoff_s: float = env_field("RESTART_BACKOFF_S", 1.0)
    restart_backoff_max_s: float = env_field("RESTART_BACKOFF_MAX_S", 60.0)

    def __post_init__(self) -> None:
        if not isinstance(self.server, ServerConfig):
            raise ConfigError(f"NodeConfig.server must be a ServerConfig, got {type(self.server).__name__}")
        if self.cuda_pools not in ("auto", "always", "never"):
            raise ConfigError(f"NodeConfig.cuda_pools must be auto, always or never, got {self.cuda_pools!r}")
        for name in ("quarantine_s", "health_interval_s", "idle_shutdown_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"NodeConfig.{name} must be a number, got {value!r}")
        if not 0 < self.quarantine_s < float("inf"):
            raise ConfigError(
                f"NodeConfig.quarantine_s must be > 0 (a margin past a request's deadline), "
                f"got {self.quarantine_s!r}"
            )
        if self.health_interval_s <= 0:
            raise ConfigError("NodeConfig.health_interval_s must be > 0")
        for name in ("unhealthy_after_s", "restart_backoff_s", "restart_backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"NodeConfig.{name} must be a number, got {value!r}")
        if not 0 < self.unhealthy_after_s < float("inf"):
            raise ConfigError(f"NodeConfig.unhealthy_after_s must be > 0, got {self.unhealthy_after_s!r}")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s < float("inf"):
            raise ConfigError(
                "NodeConfig needs 0 <= restart_backoff_s <= restart_backoff_max_s, got "
                f"{self.restart_backoff_s!r} and {self.restart_backoff_max_s!r}"
            )
        if self.idle_shutdown_s is not None and self.idle_shutdown_s < 0:
            raise ConfigError("NodeConfig.idle_shutdown_s must be >= 0 or None")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError("NodeConfig.request_timeout_s must be > 0 or None")
        if (
            isinstance(self.max_request_bytes, bool)
            or not isinstance(self.max_request_bytes, int)
            or self.max_request_bytes <= 0
        ):
            raise ConfigError(
                f"NodeConfig.max_request_bytes must be a positive integer, got {self.max_request_bytes!r}"
            )
        pools = dict(self.pools)
        if not all(isinstance(k, str) and isinstance(v, PoolConfig) for k, v in pools.items()):
            raise ConfigError("NodeConfig.pools must map model names to PoolConfig")
        if isinstance(self.preload, str) or not all(isinstance(m, str) for m in self.preload):
            raise ConfigError(f"NodeConfig.preload must be a sequence of model names, got {self.preload!r}")
        object.__setattr__(self, "pools", pools)
        object.__setattr__(self, "preload", tuple(self.preload))

    def fingerprint(self) -> str:
        """A short hash of everything the node's Triton and pools run with.

        Node actors are named by node and fingerprint: a config that differs in
        anything but client-only settings gets a Triton of its own.
        """
        fields = dataclasses.asdict(self)
        for name in _CLIENT_ONLY:
            fields.pop(name)
        for pool in (fields["default_pool"], *fields["pools"].values()):
            for name in _CLIENT_ONLY_POOL:
                pool.pop(name)
        fields["pools"] = dict(sorted(fields["pools"].items()))
        text = json.dumps(fields, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def for_repository(cls, model_repository: str | Sequence[str], **kwargs: Any) -> NodeConfig:
        """A config serving ``model_repository`` with default server settings.

        Local paths are made absolute; URIs Triton reads (``s3://``, ``gs://``,
        ``as://``) pass through unchanged; a sequence serves several repositories.
        """
        server = ServerConfig(model_repository=resolve_repositories(model_repository, must_exist=False))
        return cls(server=server, **kwargs)

    @classmethod
    def from_args(
        cls,
        model_repository: str | Sequence[str] | None = None,
        pools: Mapping[str, Mapping[str, Any]] | None = None,
        default_pool: Mapping[str, Any] | None = None,
        server: Mapping[str, Any] | None = None,
        **node_fields: Any,
    ) -> NodeConfig:
        """A config from plain values, as found under ``args`` in a Serve config file.

        The one place these values are read: the Serve app
        (``ray_triton_shm.serve:app``) and :func:`~ray_triton_shm.node.node_client`
        both build their config here, so your own deployment given the same
        ``args`` uses the same node Triton (same fingerprint) as the app.

        Args:
            model_repository: Path, URI or list of them (``examples`` or
                ``None``: the example models shipped in the package).
            pools: Model name -> :class:`PoolConfig` fields.
            default_pool: :class:`PoolConfig` fields for other models.
            server: :class:`ServerConfig` fields.
            **node_fields: Other :class:`NodeConfig` fields (``idle_shutdown_s``,
                ``health_interval_s``, ``quarantine_s``, ``preload``,
                ``request_timeout_s``, ``cuda_pools``, ...); unset ones come
                from the environment, then the defaults.

        Raises:
            ConfigError: A value is invalid or unknown, or a local repository does not exist.
        """
        server_fields = dict(server or {})
        server_fields["model_repository"] = resolve_repositories(model_repository)
        known = {f.name for f in dataclasses.fields(cls)} - {"server", "pools", "default_pool"}
        unknown = sorted(set(node_fields) - known)
        if unknown:
            raise ConfigError(f"unknown node settings {unknown}; known: {sorted(known)}")
        if "preload" in node_fields:
            node_fields["preload"] = tuple(node_fields["preload"])
        try:
            return cls(
                server=ServerConfig(**server_fields),
                pools={name: PoolConfig(**dict(fields)) for name, fields in (pools or {}).items()},
                default_pool=PoolConfig(**dict(default_pool or {})),
                **node_fields,
            )
        except TypeError as e:
            raise ConfigError(f"invalid node settings: {e}") from e

    def pool_for(self, model: str) -> PoolConfig:
        return self.pools.get(model, self.default_pool)


@dataclass(frozen=True)
class NodeInfo:
    """How clients on a node reach its Triton.

    Attributes:
        node_id: Ray node id.
        instance_id: Changes every time the actor is (re)constructed.
        epoch: Changes every time Triton is (re)started.
        grpc_url / http_url / metrics_url: Triton's endpoints (loopback).
        triton_pid: Triton's process id.
        version: Triton's version.
        restarts: How often Triton was restarted by the health check.
        gpus: GPUs the node actor (and Triton) see; 0 without cupy or GPUs.
        gpu_visible_devices: Triton's ``CUDA_VISIBLE_DEVICES`` (``None``: unset),
            to name a client's GPU in Triton's numbering.
        fingerprint: :meth:`NodeConfig.fingerprint` of what this Triton runs.
        model_repository: Its model repository.
        actor_pid: The node actor's process id.
        users_file: The segment whose byte at its own offset each user locks
            while it lives (see ``_private.node.node_registry.UserLock``).
    """

    node_id: str
    instance_id: str
    epoch: int
    grpc_url: str
    http_url: str
    metrics_url: str
    triton_pid: int
    version: str
    restarts: int
    gpus: int = 0
    gpu_visible_devices: str | None = None
    fingerprint: str = ""
    model_repository: str = ""
    actor_pid: int = -1
    users_file: str = ""


def actor_name(node_id: str, config: NodeConfig) -> str:
    """The name of the node actor that runs ``config`` on ``node_id`` (in namespace :data:`NAMESPACE`)."""
    return f"{node_prefix(node_id)}{config.fingerprint()}"


def node_prefix(node_id: str) -> str:
    """The common start of the names of ``node_id``'s node actors."""
    return f"{NAME_PREFIX}{node_id}-"


def split_app_args(args: Mapping[str, Any] | None) -> tuple[NodeConfig, dict[str, Any]]:
    """The Serve app's ``args``: the :class:`NodeConfig` and the :class:`NodeClient` options.

    ``slots_per_model`` and ``memory`` are the client's; everything else goes to
    :meth:`NodeConfig.from_args`.

    Raises:
        ConfigError: Invalid args.
    """
    rest = dict(args or {})
    slots = rest.pop("slots_per_model", None)
    memory = rest.pop("memory", "system")
    try:
        slots = None if slots is None else int(slots)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"slots_per_model must be an integer or null, got {slots!r}") from e
    return NodeConfig.from_args(**rest), {"slots_per_model": slots, "memory": str(memory)}
