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

from ray_triton_shm._private import metrics
from ray_triton_shm._private.layout import layout_from_config
from ray_triton_shm._private.node_pools import CudaRegion, Grant, NodePools, pool_key
from ray_triton_shm._private.pool import SlotPool
from ray_triton_shm._private.segment import Segment, check_span, new_segment_name, redact
from ray_triton_shm.client import InferResult, TritonShmClient, translate_error
from ray_triton_shm.config import ClientConfig, PoolConfig, ServerConfig
from ray_triton_shm.errors import (
    ConfigError,
    CudaError,
    CudaUnavailableError,
    DeviceMappingError,
    RayTritonShmError,
    TritonCallError,
    UnavailableError,
)

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
        # Triton inherits this actor's CUDA_VISIBLE_DEVICES unless ServerConfig.gpus is set. The actor
        # asks Ray for no GPU, so Ray leaves the variable as the raylet had it: all of the node's GPUs.
        gpus = config.server.gpus
        self._gpu_visible = ",".join(map(str, gpus)) if gpus is not None else os.environ.get(_CVD)
        self._gpu_count = _local_gpu_count()
        self._server.start()  # sweeps segments of a previous incarnation first
        self._epoch = 1
        self._grpc = grpcclient.InferenceServerClient(self._server.grpc_url)
        self._pools = NodePools(self._register, self._unregister, quarantine_s=config.quarantine_s)
        # (model, path) -> [requests, bytes], summed from the clients' reports.
        self._traffic: dict[tuple[str, str], list[int]] = {}
        for model in config.preload:
            self._ensure_pool(model)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="triton-node-health", daemon=True)
        self._watcher.start()
        logger.info(
            "node actor %s up: Triton %s at %s", self.node_id, self._server.version, self._server.grpc_url
        )

    # -- Triton ------------------------------------------------------------
    def _register(self, region: Any) -> None:
        check_span(region.name, region.size, 0, region.size)
        headers = self._server.shm_api_headers
        try:
            if isinstance(region, CudaRegion):
                buffer = region.buffer
                self._grpc.register_cuda_shared_memory(
                    region.name, buffer.handle_b64, region.server_device, region.size, headers=headers
                )
            else:
                self._grpc.register_system_shared_memory(
                    region.name, region.key, region.size, headers=headers
                )
        except InferenceServerException as e:
            if isinstance(region, CudaRegion):
                message = redact(str(e.message() or e))
                raise CudaError(f"Triton refused CUDA region {region.name!r}: {message}") from e
            raise translate_error(e) from e

    def _unregister(self, region: Any) -> None:
        headers = self._server.shm_api_headers
        if isinstance(region, CudaRegion):
            self._grpc.unregister_cuda_shared_memory(region.name, headers=headers)
        else:
            self._grpc.unregister_system_shared_memory(region.name, headers=headers)

    def _ensure_pool(self, model: str, device: int | None = None, force_cuda: bool = False) -> str:
        """Create ``model``'s pool (a CUDA one on Triton's GPU ``device`` if allowed); return its key."""
        pool_config = self.config.pool_for(model)
        model_config = self._model_config(model)
        layout = layout_from_config(model_config, pool_config)
        if device is None or not self._cuda_allowed(model_config, pool_config, force_cuda):
            self._pools.ensure_pool(model, layout, pool_config)
            return model
        key = pool_key(model, "cuda", device)
        local = self._local_device(device)

        def make_region(size: int) -> CudaRegion:
            from ray_triton_shm._private.cuda import DeviceBuffer

            return CudaRegion(DeviceBuffer.allocate(size, local), new_segment_name("ncuda"), device)

        self._pools.ensure_pool(model, layout, pool_config, key=key, make_region=make_region)
        return key

    def _model_config(self, model: str) -> dict[str, Any]:
        try:
            return self._grpc.get_model_config(model, as_json=True)["config"]
        except InferenceServerException as e:
            raise translate_error(e, model) from e

    def _cuda_allowed(self, model_config: Mapping[str, Any], pool: PoolConfig, force: bool) -> bool:
        if self._gpu_count == 0 or self.config.cuda_pools == "never":
            return False
        return (
            self.config.cuda_pools == "always" or force or pool.memory == "cuda" or runs_on_gpu(model_config)
        )

    def _local_device(self, server_device: int) -> int:
        """This actor's index of the GPU Triton calls ``server_device``."""
        from ray_triton_shm._private.cuda import server_device_id

        mine = os.environ.get(_CVD)
        for index in range(self._gpu_count):
            if server_device_id(index, mine, self._gpu_visible) == server_device:
                return index
        raise DeviceMappingError(
            f"Triton's GPU {server_device} is not visible to the node actor "
            f"(actor {_CVD}={mine!r}, Triton's {self._gpu_visible!r})"
        )

    def _watch(self) -> None:
        while not self._stopping.wait(self.config.health_interval_s):
            try:
                self.check()
            except Exception:
                logger.exception("node health check failed")
            try:
                metrics.record_pool_gauges(self.node_id, self._pools.stats())
            except Exception:
                logger.debug("pool gauges failed", exc_info=True)

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
                try:
                    metrics.record_restart(self.node_id)
                except Exception:
                    logger.debug("restart metric failed", exc_info=True)
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
                gpus=self._gpu_count,
                gpu_visible_devices=self._gpu_visible,
            )

    def acquire(
        self,
        model: str,
        want: int,
        owner_pid: int,
        timeout: float,
        device: int | None = None,
        force_cuda: bool = False,
    ) -> Grant:
        """Grant up to ``want`` slots of ``model`` to process ``owner_pid`` on this node.

        Args:
            model: Model name.
            want: Slots wanted (at least one is granted).
            owner_pid: The client process; its slots come back when it dies.
            timeout: Seconds to wait for free slots.
            device: The client's GPU in Triton's numbering, if it wants GPU memory;
                it gets a CUDA pool there when :attr:`NodeConfig.cuda_pools` allows.
            force_cuda: The client insists on GPU memory (any model, if the node has GPUs).

        Raises:
            PoolTimeoutError: No slot became free in time.
            TritonCallError / LayoutError: The model is unknown or cannot use slots.
            CudaError: The GPU region could not be made or registered.
        """
        with self._lock:
            key = self._ensure_pool(model, device, force_cuda)
        return self._pools.acquire(model, want, owner_pid, timeout, key=key)

    def release(self, grant_id: str) -> bool:
        """Return a grant's slots."""
        return self._pools.release(grant_id)

    def stats(self) -> dict[str, Any]:
        """Triton identity plus per-model slot counts."""
        return {"info": dataclasses.asdict(self.info()), "pools": self._pools.stats()}

    def report(self, traffic: Sequence[tuple[str, str, int, int]]) -> None:
        """Add a client's traffic sums, ``(model, path, requests, bytes)`` rows (see ``_private.metrics``)."""
        with self._lock:
            for model, path, requests, nbytes in traffic:
                entry = self._traffic.setdefault((str(model), str(path)), [0, 0])
                entry[0] += int(requests)
                entry[1] += int(nbytes)

    def status(self) -> dict[str, Any]:
        """What ``ray-triton-shm status`` shows: Triton, its models, pools, traffic by path."""
        with self._lock:
            traffic = [
                {"model": model, "path": path, "requests": v[0], "bytes": v[1]}
                for (model, path), v in sorted(self._traffic.items())
            ]
            grpc = self._grpc
        try:
            index = grpc.get_model_repository_index(as_json=True).get("models", [])
            models = [
                {"name": m.get("name", ""), "version": m.get("version", ""), "state": m.get("state", "")}
                for m in index
            ]
        except InferenceServerException as e:
            models = [{"name": "?", "version": "", "state": f"unavailable: {e.message()}"}]
        return {
            "info": dataclasses.asdict(self.info()),
            "pools": self._pools.stats(),
            "models": models,
            "traffic": traffic,
        }

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


_CVD = "CUDA_VISIBLE_DEVICES"


def _local_gpu_count() -> int:
    """GPUs this process sees through cupy; 0 without cupy or GPUs."""
    from ray_triton_shm._private.cuda import device_count

    try:
        return device_count()
    except CudaUnavailableError:
        return 0


def runs_on_gpu(model_config: Mapping[str, Any]) -> bool:
    """Whether Triton runs some instance of the model on a GPU (instance_group kind GPU)."""
    groups = model_config.get("instance_group") or []
    return any(str(group.get("kind", "")).endswith("GPU") for group in groups)


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

    def __init__(
        self,
        actor: ray.actor.ActorHandle,
        slots_per_model: int,
        timeout_s: float,
        info: NodeInfo | None = None,
        force_cuda: bool = False,
    ) -> None:
        self._actor = actor
        self._want = slots_per_model
        self._timeout = timeout_s
        self._info = info
        self._force_cuda = force_cuda
        self._held: list[tuple[Grant, SlotPool]] = []

    def _server_device(self, config: PoolConfig) -> tuple[int, int] | None:
        """(this process's GPU, Triton's id for it) when the pool should be in GPU memory."""
        if config.memory != "cuda":
            return None
        from ray_triton_shm._private.cuda import require_device, server_device_id

        local = require_device(config.device_id)
        visible = self._info.gpu_visible_devices if self._info else None
        return local, server_device_id(local, os.environ.get(_CVD), visible)

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        devices = self._server_device(config)
        request = self._actor.acquire.remote(
            model,
            self._want,
            os.getpid(),
            self._timeout,
            devices[1] if devices else None,
            self._force_cuda,
        )
        grant: Grant = ray.get(request)
        try:
            if grant.memory == "cuda" and devices is not None:
                from ray_triton_shm._private.cuda import DeviceBuffer
                from ray_triton_shm._private.cuda_pool import CudaSlotPool

                buffer = DeviceBuffer.open(grant.cuda_handle, grant.segment_size, devices[0])
                pool: SlotPool = CudaSlotPool(buffer, grant.segment_name, grant.layout, grant.slots)
            else:
                if devices is not None:
                    logger.info("node gave %s a system-memory pool (model not on GPU or no GPUs)", model)
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
        memory: ``"system"`` (default; outputs are numpy), ``"cuda"`` (slots in
            this process's GPU memory, outputs are cupy arrays; any model) or
            ``"auto"`` (GPU memory when this process sees a GPU and the model
            runs on GPU; else system memory). See docs/cuda.md.
        device_id: For GPU memory: this process's GPU (default cupy's current one).

    Raises:
        ConfigError: Unknown ``memory``.
        CudaUnavailableError / NoGpuError: ``memory="cuda"`` without cupy or a GPU.
    """

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        slots_per_model: int = 2,
        lease_timeout_s: float = 30.0,
        request_timeout_s: float | None = 60.0,
        memory: str = "system",
        device_id: int | None = None,
    ) -> None:
        if memory not in ("system", "cuda", "auto"):
            raise ConfigError(f"NodeClient memory must be system, cuda or auto, got {memory!r}")
        # An explicit "cuda" gets GPU memory for any model; "auto" only for models that run on GPU.
        self._force_cuda = memory == "cuda"
        if memory == "cuda":
            from ray_triton_shm._private.cuda import require_device

            require_device(device_id)
        elif memory == "auto":
            memory = "cuda" if _local_gpu_count() > 0 else "system"
        self._memory = memory
        self._device_id = device_id
        self._config = config
        self._slots = slots_per_model
        self._lease_timeout = lease_timeout_s
        self._request_timeout = request_timeout_s
        self._lock = threading.Lock()
        self._inner: TritonShmClient | None = None
        self._observer: metrics.RayMetricsObserver | None = None
        self.info: NodeInfo | None = None
        self._connect()

    def _connect(self) -> TritonShmClient:
        actor = get_node_actor(self._config)
        info: NodeInfo = ray.get(actor.info.remote())
        pool = PoolConfig(
            slots=self._slots,
            lease_timeout_s=self._lease_timeout,
            memory=self._memory,
            device_id=self._device_id,
        )
        client_config = ClientConfig(
            url=info.grpc_url,
            http_url=info.http_url,
            default_pool=pool,
            request_timeout_s=self._request_timeout,
        )
        observer = metrics.RayMetricsObserver(actor)
        source = _GrantedPools(actor, self._slots, self._lease_timeout, info, self._force_cuda)
        inner = TritonShmClient(client_config, pool_source=source, observer=observer)
        old, self._inner, self.info = self._inner, inner, info
        old_observer, self._observer = self._observer, observer
        if old is not None:
            old.close()
        if old_observer is not None:
            old_observer.close()
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
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        copy: bool = True,
    ) -> InferResult:
        """See :meth:`TritonShmClient.infer`; reconnects for the next call after a Triton restart.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError.
        """
        try:
            return self.client.infer(model, inputs, outputs=outputs, copy=copy)
        except (UnavailableError, TritonCallError):
            self._reconnect_if_changed()
            raise

    async def ainfer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        copy: bool = True,
    ) -> InferResult:
        """See :meth:`TritonShmClient.ainfer`."""
        import asyncio

        try:
            return await self.client.ainfer(model, inputs, outputs=outputs, copy=copy)
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

    def flush_reports(self) -> None:
        """Send the traffic counted so far to the node actor now (fire-and-forget).

        For short-lived workers (Ray Data actors are killed when their job ends,
        without a ``close``) whose whole run can fit in one reporting interval.
        """
        observer = self._observer
        if observer is not None:
            observer.flush()

    def close(self) -> None:
        """Give the slots back to the node actor. Idempotent."""
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
