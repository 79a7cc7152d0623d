"""One Triton server per Ray node, owned by a node actor, and clients that use it.

Example:
    >>> import ray
    >>> from ray_triton_shm.node import NodeClient, NodeConfig, ensure_node_actors
    >>> ray.init()                                                          # doctest: +SKIP
    >>> ensure_node_actors(NodeConfig.for_repository("deployments/models"))  # doctest: +SKIP
    >>> client = NodeClient()            # in any task/actor: the Triton of its own node
    >>> client.infer("add_sub", {"INPUT0": a, "INPUT1": b})                 # doctest: +SKIP

The node actor starts and pins Triton, owns the node's shared-memory
segments (registered once), and grants slots to client processes. Data never
goes through the actor: clients write into their slots and call Triton
themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import tritonclient.grpc as grpcclient
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.node_pools import Grant, NodePools
from ray_triton_shm._private.pool import SlotPool
from ray_triton_shm._private.segment import Segment, check_span
from ray_triton_shm.client import InferResult, TritonShmClient, fetch_layout, translate_error
from ray_triton_shm.config import ClientConfig, PoolConfig, ServerConfig
from ray_triton_shm.errors import ConfigError, RayTritonShmError, TritonCallError, UnavailableError

__all__ = [
    "NAMESPACE",
    "NodeClient",
    "NodeConfig",
    "NodeInfo",
    "TritonNodeActor",
    "actor_name",
    "ensure_node_actors",
    "get_node_actor",
    "shutdown_node_actors",
]

logger = logging.getLogger(__name__)

NAMESPACE = "ray_triton_shm"
_NAME_PREFIX = "triton-node-"


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
    """

    server: ServerConfig
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)
    default_pool: PoolConfig = field(default_factory=PoolConfig)
    preload: tuple[str, ...] = ()
    quarantine_s: float = 30.0
    health_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.quarantine_s < 0:
            raise ConfigError("NodeConfig.quarantine_s must be >= 0")
        if self.health_interval_s <= 0:
            raise ConfigError("NodeConfig.health_interval_s must be > 0")
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


def actor_name(node_id: str) -> str:
    """The node actor's name for ``node_id`` (in namespace :data:`NAMESPACE`)."""
    return _NAME_PREFIX + node_id


class _NodeActor:
    """Body of :data:`TritonNodeActor` (see the module docstring)."""

    def __init__(self, config: NodeConfig) -> None:
        from ray_triton_shm.server import TritonServer

        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        # Only this actor registers regions, so the shm endpoints can always be keyed.
        protect = config.server.protect_shm_api is not False
        self._server = TritonServer(config.server, protect_shm_api=protect)
        self._server.start()  # sweeps segments of a previous incarnation first
        self._epoch = 1
        self._grpc = grpcclient.InferenceServerClient(self._server.grpc_url)
        self._pools = NodePools(self._register, self._unregister, quarantine_s=config.quarantine_s)
        for model in config.preload:
            self._ensure_pool(model)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="triton-node-health", daemon=True)
        self._watcher.start()
        logger.info(
            "node actor %s up: Triton %s at %s", self.node_id, self._server.version, self._server.grpc_url
        )

    # -- Triton ------------------------------------------------------------
    def _register(self, name: str, key: str, size: int) -> None:
        check_span(name, size, 0, size)
        try:
            self._grpc.register_system_shared_memory(name, key, size, headers=self._server.shm_api_headers)
        except InferenceServerException as e:
            raise translate_error(e) from e

    def _unregister(self, name: str) -> None:
        self._grpc.unregister_system_shared_memory(name, headers=self._server.shm_api_headers)

    def _ensure_pool(self, model: str) -> None:
        pool_config = self.config.pool_for(model)
        layout = fetch_layout(self._grpc, model, pool_config)
        self._pools.ensure_pool(model, layout, pool_config)

    def _watch(self) -> None:
        while not self._stopping.wait(self.config.health_interval_s):
            try:
                self.check()
            except Exception:
                logger.exception("node health check failed")

    def check(self) -> dict[str, int]:
        """Restart Triton if it died (re-registering every region); reclaim slots of dead clients.

        Returns:
            ``{"restarted": 0|1, "reclaimed": n}``.
        """
        restarted = 0
        with self._lock:
            if not self._stopping.is_set() and not self._server.is_alive():
                logger.warning("Triton on node %s died; restarting", self.node_id)
                self._server.restart()
                self._grpc.close()
                self._grpc = grpcclient.InferenceServerClient(self._server.grpc_url)
                self._pools.register_all()
                self._epoch += 1
                restarted = 1
        return {"restarted": restarted, "reclaimed": self._pools.reclaim()}

    # -- API ---------------------------------------------------------------
    def info(self) -> NodeInfo:
        """Endpoints and identity of this node's Triton."""
        with self._lock:
            server = self._server
            return NodeInfo(
                node_id=self.node_id,
                instance_id=self.instance_id,
                epoch=self._epoch,
                grpc_url=server.grpc_url,
                http_url=server.http_url,
                metrics_url=server.metrics_url,
                triton_pid=server.pid or -1,
                version=server.version,
                restarts=server.restarts,
            )

    def acquire(self, model: str, want: int, owner_pid: int, timeout: float) -> Grant:
        """Grant up to ``want`` slots of ``model`` to process ``owner_pid`` on this node.

        Raises:
            PoolTimeoutError: No slot became free in time.
            TritonCallError / LayoutError: The model is unknown or cannot use slots.
        """
        with self._lock:
            self._ensure_pool(model)
        return self._pools.acquire(model, want, owner_pid, timeout)

    def release(self, grant_id: str) -> bool:
        """Return a grant's slots."""
        return self._pools.release(grant_id)

    def stats(self) -> dict[str, Any]:
        """Triton identity plus per-model slot counts."""
        return {"info": dataclasses.asdict(self.info()), "pools": self._pools.stats()}

    def kill_triton(self) -> int:
        """SIGKILL this node's Triton (for fault tests); the health check restarts it.

        Returns:
            The killed process id.
        """
        pid = self._server.pid or -1
        if pid > 0:
            os.kill(pid, 9)
        return pid

    def shutdown(self) -> None:
        """Unregister and unlink every segment, stop Triton. Idempotent."""
        self._stopping.set()
        with self._lock:
            self._pools.close()
            self._server.stop()
            self._grpc.close()


TritonNodeActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=32)(_NodeActor)
"""The node actor class: ``TritonNodeActor.options(...).remote(NodeConfig)``."""


def _spawn(node_id: str, config: NodeConfig) -> ray.actor.ActorHandle:
    return TritonNodeActor.options(
        name=actor_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(config)


def get_node_actor(config: NodeConfig | None = None, *, node_id: str | None = None) -> ray.actor.ActorHandle:
    """The node actor of ``node_id`` (default: the calling process's node).

    Creates it with ``config`` if it does not exist yet (a node that joined
    after :func:`ensure_node_actors` ran gets its actor this way).

    Raises:
        RayTritonShmError: No actor exists and no config was given.
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    try:
        return ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:
        if config is None:
            raise RayTritonShmError(
                f"no Triton node actor on node {node_id}; call ensure_node_actors(config) first"
            ) from None
    return _spawn(node_id, config)


def ensure_node_actors(config: NodeConfig, *, timeout_s: float = 180.0) -> dict[str, NodeInfo]:
    """Make sure every alive node has a node actor with a ready Triton.

    Call it again (e.g. periodically) to cover nodes the autoscaler added.

    Returns:
        NodeInfo by node id.

    Raises:
        ray.exceptions.RayActorError: An actor failed to start Triton.
    """
    node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    actors = {node_id: _spawn(node_id, config) for node_id in node_ids}
    infos = ray.get([a.info.remote() for a in actors.values()], timeout=timeout_s)
    return dict(zip(actors, infos))


def shutdown_node_actors(*, timeout_s: float = 60.0) -> int:
    """Shut down and kill every node actor (Triton stopped, segments removed).

    Returns:
        How many actors were shut down.
    """
    count = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE or not entry["name"].startswith(_NAME_PREFIX):
            continue
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
                ray.get(actor.shutdown.remote(), timeout=timeout_s)
                ray.kill(actor, no_restart=True)
                count += 1
                break
            except ValueError:
                break  # already gone
            except ray.exceptions.RayError as e:
                # A restarting actor answers once it is back; then it can shut down.
                if time.monotonic() > deadline:
                    logger.warning("could not shut down %s: %s", entry["name"], e)
                    break
                time.sleep(0.5)
    return count


class _GrantedPools:
    """A client's :class:`PoolSource` backed by slots granted by the node actor."""

    def __init__(self, actor: ray.actor.ActorHandle, slots_per_model: int, timeout_s: float) -> None:
        self._actor = actor
        self._want = slots_per_model
        self._timeout = timeout_s
        self._held: list[tuple[Grant, SlotPool]] = []

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        grant: Grant = ray.get(self._actor.acquire.remote(model, self._want, os.getpid(), self._timeout))
        try:
            segment = Segment.attach(grant.segment_name, grant.segment_size)
            pool = SlotPool(segment, grant.layout, grant.slots)
        except BaseException:
            self._actor.release.remote(grant.grant_id)
            raise
        self._held.append((grant, pool))
        return pool

    def close(self) -> None:
        held, self._held = self._held, []
        for grant, pool in held:
            pool.close()
            try:
                ray.get(self._actor.release.remote(grant.grant_id), timeout=10)
            except ray.exceptions.RayError as e:
                logger.debug("release of %s failed: %s", grant.grant_id, e)


class NodeClient:
    """Zero-copy inference against the Triton of the calling process's node.

    Has the inference API of :class:`~ray_triton_shm.TritonShmClient`
    (``infer``, ``ainfer``, ``infer_views``, ``lease``/``run``,
    ``infer_grpc``). If Triton restarts or the node actor is replaced, the
    next call reconnects; the call that was in flight fails with
    :class:`UnavailableError` or :class:`TritonCallError`.

    Args:
        config: Creates the node actor if the node has none yet.
        slots_per_model: Slots this process asks for per model.
        lease_timeout_s: How long to wait for slots (grant and per request).
        request_timeout_s: Deadline of one inference call.
    """

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        slots_per_model: int = 2,
        lease_timeout_s: float = 30.0,
        request_timeout_s: float | None = 60.0,
    ) -> None:
        self._config = config
        self._slots = slots_per_model
        self._lease_timeout = lease_timeout_s
        self._request_timeout = request_timeout_s
        self._lock = threading.Lock()
        self._inner: TritonShmClient | None = None
        self.info: NodeInfo | None = None
        self._connect()

    def _connect(self) -> TritonShmClient:
        actor = get_node_actor(self._config)
        info: NodeInfo = ray.get(actor.info.remote())
        pool = PoolConfig(slots=self._slots, lease_timeout_s=self._lease_timeout)
        client_config = ClientConfig(
            url=info.grpc_url, default_pool=pool, request_timeout_s=self._request_timeout
        )
        inner = TritonShmClient(
            client_config, pool_source=_GrantedPools(actor, self._slots, self._lease_timeout)
        )
        old, self._inner, self.info = self._inner, inner, info
        if old is not None:
            old.close()
        return inner

    def _reconnect_if_changed(self) -> bool:
        """After a failure: reconnect if Triton or the actor changed. Returns whether it did."""
        with self._lock:
            try:
                actor = get_node_actor(self._config)
                info: NodeInfo = ray.get(actor.info.remote(), timeout=60)
            except (RayTritonShmError, ray.exceptions.RayError):
                return False
            current = self.info
            if current and (info.instance_id, info.epoch, info.grpc_url) == (
                current.instance_id,
                current.epoch,
                current.grpc_url,
            ):
                return False
            logger.info(
                "node Triton changed (epoch %s -> %s); reconnecting", current and current.epoch, info.epoch
            )
            self._connect()
            return True

    @property
    def client(self) -> TritonShmClient:
        """The underlying client for the current connection."""
        if self._inner is None:
            raise RayTritonShmError("NodeClient is closed")
        return self._inner

    def infer(
        self, model: str, inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None
    ) -> InferResult:
        """See :meth:`TritonShmClient.infer`; reconnects for the next call after a Triton restart.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError.
        """
        try:
            return self.client.infer(model, inputs, outputs=outputs)
        except (UnavailableError, TritonCallError):
            self._reconnect_if_changed()
            raise

    async def ainfer(
        self, model: str, inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None
    ) -> InferResult:
        """See :meth:`TritonShmClient.ainfer`."""
        import asyncio

        try:
            return await self.client.ainfer(model, inputs, outputs=outputs)
        except (UnavailableError, TritonCallError):
            await asyncio.to_thread(self._reconnect_if_changed)
            raise

    def infer_grpc(self, model: str, inputs: Mapping[str, Any]) -> InferResult:
        """See :meth:`TritonShmClient.infer_grpc` (plain gRPC, for comparison)."""
        return self.client.infer_grpc(model, inputs)

    def infer_views(self, model: str, inputs: Mapping[str, Any]):
        """See :meth:`TritonShmClient.infer_views`."""
        return self.client.infer_views(model, inputs)

    def model_config(self, model: str) -> dict[str, Any]:
        """The model's configuration as Triton reports it."""
        return self.client._grpc.get_model_config(model, as_json=True)["config"]

    def model_metadata(self, model: str) -> dict[str, Any]:
        """The model's KServe v2 metadata."""
        return self.client._grpc.get_model_metadata(model, as_json=True)

    def close(self) -> None:
        """Give the slots back to the node actor. Idempotent."""
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
