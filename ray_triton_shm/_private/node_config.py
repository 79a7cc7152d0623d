"""The node layer's configuration and identity: what a node actor runs and how clients reach it.

Example:
    >>> from ray_triton_shm.node import NodeConfig
    >>> config = NodeConfig.for_repository("deployments/models", preload=("add_sub",))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm.config import PoolConfig, ServerConfig, env_field
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
    preload: tuple[str, ...] = ()
    quarantine_s: float = 30.0
    health_interval_s: float = 0.5
    cuda_pools: str = "auto"
    unhealthy_after_s: float = env_field("UNHEALTHY_AFTER_S", 15.0)
    restart_backoff_s: float = env_field("RESTART_BACKOFF_S", 1.0)
    restart_backoff_max_s: float = env_field("RESTART_BACKOFF_MAX_S", 60.0)

    def __post_init__(self) -> None:
        if self.cuda_pools not in ("auto", "always", "never"):
            raise ConfigError(f"NodeConfig.cuda_pools must be auto, always or never, got {self.cuda_pools!r}")
        if self.quarantine_s < 0:
            raise ConfigError("NodeConfig.quarantine_s must be >= 0")
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
        object.__setattr__(self, "pools", dict(self.pools))
        object.__setattr__(self, "preload", tuple(self.preload))

    @classmethod
    def for_repository(cls, model_repository: str, **kwargs: Any) -> NodeConfig:
        """A config serving ``model_repository`` (made absolute) with default server settings."""
        server = ServerConfig(model_repository=os.path.abspath(model_repository))
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
