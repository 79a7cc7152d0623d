"""The node layer's configuration and identity: what a node actor runs and how clients reach it.

Example:
    >>> from ray_triton_shm.node import NodeConfig
    >>> config = NodeConfig.for_repository("deployments/models", preload=("add_sub",))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.errors import ConfigError

NAMESPACE = "ray_triton_shm"
_NAME_PREFIX = "triton-node-"
_CVD = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """What each node actor runs.

    Attributes:
        server: How to start the node's Triton.
        pools: Pool settings by model; other models use ``default_pool``.
        default_pool: Pool settings for models not in ``pools``.
        preload: Models whose pools are created when the actor starts.
        quarantine_s: How long slots of a dead client are held back.
        health_interval_s: How often Triton's health and client liveness are checked.
        cuda_pools: When clients that ask for GPU memory get CUDA pools:
            ``"auto"`` for models whose instances run on GPU (or whose pool
            config says ``memory="cuda"``) on nodes with GPUs, ``"always"``
            for every model on nodes with GPUs, ``"never"``. Others get
            system-memory pools.
    """

    server: ServerConfig
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)
    default_pool: PoolConfig = field(default_factory=PoolConfig)
    preload: tuple[str, ...] = ()
    quarantine_s: float = 30.0
    health_interval_s: float = 0.5
    cuda_pools: str = "auto"

    def __post_init__(self) -> None:
        if self.cuda_pools not in ("auto", "always", "never"):
            raise ConfigError(f"NodeConfig.cuda_pools must be auto, always or never, got {self.cuda_pools!r}")
        if self.quarantine_s < 0:
            raise ConfigError("NodeConfig.quarantine_s must be >= 0")
        if self.health_interval_s <= 0:
            raise ConfigError("NodeConfig.health_interval_s must be > 0")
        object.__setattr__(self, "pools", dict(self.pools))
        object.__setattr__(self, "preload", tuple(self.preload))

    @classmethod
    def for_repository(cls, model_repository: str | Sequence[str], **kwargs: Any) -> NodeConfig:
        """A config serving ``model_repository`` with default server settings.

        Local paths are made absolute; URIs Triton reads (``s3://``, ``gs://``,
        ``as://``) pass through unchanged; a sequence serves several repositories.
        """
        from ray_triton_shm._private.repository import resolve_repositories

        server = ServerConfig(model_repository=resolve_repositories(model_repository, must_exist=False))
        return cls(server=server, **kwargs)

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


def actor_name(node_id: str) -> str:
    """The node actor's name for ``node_id`` (in namespace :data:`NAMESPACE`)."""
    return _NAME_PREFIX + node_id
