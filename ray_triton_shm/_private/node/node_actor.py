"""The node actor: starts and pins a node's Triton, owns its pools, grants slots to client processes.

Example:
    >>> from ray_triton_shm.node import TritonNodeActor, NodeConfig
    >>> actor = TritonNodeActor.options(name="n").remote(NodeConfig.for_repository("m"))  # doctest: +SKIP
    >>> ray.get(actor.info.remote()).grpc_url                                            # doctest: +SKIP

Data never goes through the actor: clients write into their slots and call
Triton themselves. The models' side (their configurations, pools and model
control) is :class:`~ray_triton_shm._private.node.node_models.NodeModels`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.node import metrics
from ray_triton_shm._private.node.held_doors import HeldDoors
from ray_triton_shm._private.node.node_config import CVD, NodeConfig, NodeInfo
from ray_triton_shm._private.node.node_health import HealthMonitor
from ray_triton_shm._private.node.node_models import CONTROL_TIMEOUT_S, NodeModels
from ray_triton_shm._private.node.node_pools import CudaRegion, Grant, NodePools
from ray_triton_shm._private.node.node_registry import Users
from ray_triton_shm._private.node.reaper import Reaper
from ray_triton_shm._private.shm.cuda import local_gpu_count
from ray_triton_shm._private.shm.segment import Segment, check_span, new_segment_name, redact
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm._private.triton.grpc_channel import new_grpc_client, unregister_region
from ray_triton_shm.errors import (
    CudaError,
    UnavailableError,
)
from ray_triton_shm.server import TritonServer

logger = logging.getLogger(__name__)

# Longest a retired region's unregister waits for Triton to let go of its last request.
_UNREGISTER_WAIT_S = 5.0


class _NodeActor(NodeModels):
    """Body of :data:`TritonNodeActor` (see the module docstring)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._fingerprint = config.fingerprint()
        # Users lock a byte of it while they live (see node_registry.UserLock).
        self._users_file = Segment.create(new_segment_name("users"), 1)
        self._users = Users(self._users_file.name)
        self._retiring = False
        # Cleans up if this process dies without shutdown(): kills Triton, unlinks our segments.
        self._reaper = Reaper()
        self._health, self._restart_lock = _new_health(config), threading.Lock()
        # Only this actor registers regions, so the shm endpoints can always be keyed.
        protect = config.server.protect_shm_api is not False
        self._server = TritonServer(config.server, protect_shm_api=protect)
        # Triton inherits this actor's CUDA_VISIBLE_DEVICES unless ServerConfig.gpus is set. The actor
        # asks Ray for no GPU, so Ray leaves the variable as the raylet had it: all of the node's GPUs.
        gpus = config.server.gpus
        self._gpu_visible = ",".join(map(str, gpus)) if gpus is not None else os.environ.get(CVD)
        self._gpu_count = local_gpu_count()
        # The reaper learns each Triton as it is launched, long before its models are loaded.
        self._server.on_launch = self._reaper.watch_triton
        self._server.on_python_env = self._reaper.watch_python_env  # the Python backend's directory
        try:
            self._server.start()  # sweeps segments of a previous incarnation first
        except BaseException:
            self._reaper.close()
            self._users.close()
            self._users_file.close()
            raise
        self._epoch = 1
        self._grpc = new_grpc_client(self._server.grpc_url)
        self._pools = NodePools(self._register, self._unregister, quarantine_s=config.quarantine_s)
        # Model configs as Triton served them when last asked: fetched again only after a load,
        # unload or restart, or when a client found the served config changed (layout_changed).
        self._configs: dict[str, dict[str, Any]] = {}
        # (model, path) -> [requests, bytes], summed from the clients' reports.
        self._traffic: dict[tuple[str, str], list[int]] = {}
        # user id -> its front door's last report (ports, connections, calls), while it is attached.
        self._doors: dict[str, dict[str, Any]] = {}
        # Front-door listening sockets kept open between an app's replicas (a redeploy).
        self._held_doors = HeldDoors()
        for model in config.preload:
            self._ensure_pool(model)
        self._stopping = threading.Event()
        # Users can attach from now on: Triton's start (it may take minutes) is not idle time, or
        # an actor that Ray restarted would retire before its users had found it again.
        self._users.start_idle_clock()
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
                    region.name,
                    buffer.handle_b64,
                    region.server_device,
                    region.size,
                    headers=headers,
                    client_timeout=CONTROL_TIMEOUT_S,
                )
            else:
                self._grpc.register_system_shared_memory(
                    region.name, region.key, region.size, headers=headers, client_timeout=CONTROL_TIMEOUT_S
                )
        except InferenceServerException as e:
            if isinstance(region, CudaRegion):
                message = redact(str(e.message() or e))
                raise CudaError(f"Triton refused CUDA region {region.name!r}: {message}") from e
            raise translate_error(e) from e

    def _unregister(self, region: Any) -> None:
        unregister_region(
            self._grpc,
            region.name,
            isinstance(region, CudaRegion),
            _UNREGISTER_WAIT_S,
            headers=self._server.shm_api_headers,
            client_timeout=CONTROL_TIMEOUT_S,
        )

    def _watch(self) -> None:
        while not self._stopping.wait(self.config.health_interval_s):
            try:
                self.check()
            except Exception:
                logger.exception("node health check failed")
            try:
                self._check_users()
            except Exception:
                logger.exception("node user check failed")
            try:
                self._held_doors.sweep()
            except Exception:
                logger.exception("front-door sweep failed")
            try:
                self._reaper.check()  # a reaper that died (OOM) is started again; status shows it
            except Exception:
                logger.exception("reaper check failed")
            try:
                metrics.record_pool_gauges(self.node_id, self._pools.stats())
            except Exception:
                logger.debug("pool gauges failed", exc_info=True)

    def check(self) -> dict[str, int]:
        """Probe Triton; restart it if dead or unready too long (see ``_private.node.node_health``).

        Returns:
            ``{"restarted": 0|1}``.
        """
        restarted = 0
        if not self._stopping.is_set():
            server = self._server
            started = time.monotonic()
            alive = server.is_alive()
            ready = alive and server.probe(timeout=_probe_timeout(self.config))
            if self._health.observe(ready=ready, alive=alive, started_at=started):
                restarted = self._restart_triton(alive)
        return {"restarted": restarted}

    def _restart_triton(self, alive: bool) -> int:
        """SIGKILL (if still there) and start Triton again, outside the actor's lock; then swap in
        a client for it, re-register every region and bump the epoch under the lock.

        Returns:
            1 if a new Triton is up, 0 if another thread is restarting or the start failed.
        """
        if not self._restart_lock.acquire(blocking=False):
            return 0
        try:
            self._health.restart_started()
            pid = self._server.pid
            if alive:
                logger.warning("Triton (pid %s) on node %s stopped answering; killing it", pid, self.node_id)
            else:
                logger.warning("Triton (pid %s) on node %s died; restarting", pid, self.node_id)
            try:
                self._server.restart(kill=True)  # SIGKILL works on a stopped or hung process too
                # Its own subchannels: the old channel's reconnect backoff from the dead Triton stays there.
                grpc = new_grpc_client(self._server.grpc_url)
                with self._lock:
                    if self._stopping.is_set():
                        grpc.close()
                        self._health.restart_finished(False, "node is shutting down")
                        return 0
                    old, self._grpc = self._grpc, grpc
                    self._configs.clear()  # the new Triton read the repository again
                    self._forget_regions()
                    self._pools.register_all()
                    self._epoch += 1
                old.close()
            except Exception as e:
                logger.exception("restarting Triton on node %s failed", self.node_id)
                self._health.restart_finished(False, redact(f"{type(e).__name__}: {e}")[:500])
                return 0
            self._health.restart_finished(True)
            try:
                metrics.record_restart(self.node_id)
            except Exception:
                logger.debug("restart metric failed", exc_info=True)
            return 1
        finally:
            self._restart_lock.release()

    def _forget_regions(self) -> None:
        """Unregister every region on the new Triton: a grant racing the restart may have
        registered one already, and ``register_all`` registers them all again."""
        headers, timeout = self._server.shm_api_headers, CONTROL_TIMEOUT_S
        for unregister in (
            self._grpc.unregister_system_shared_memory,
            self._grpc.unregister_cuda_shared_memory,
        ):
            try:
                unregister(headers=headers, client_timeout=timeout)
            except InferenceServerException as e:
                logger.debug("unregistering all regions failed: %s", e)

    def _require_healthy(self) -> None:
        """Fail fast (instead of waiting on a hung Triton) while Triton is not answering."""
        state = self._health.state
        if state in ("backoff", "restarting"):
            raise UnavailableError(
                f"Triton on node {self.node_id} is {state}; try again shortly", "UNAVAILABLE"
            )

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
                fingerprint=self._fingerprint,
                model_repository=self.config.server.model_repository,
                actor_pid=os.getpid(),
                users_file=self._users_file.name,
            )

    def acquire(self, model: str, device: int | None = None, force_cuda: bool = False) -> Grant:
        """What a client process needs to share ``model``'s pool (created on first use).

        Args:
            model: Model name.
            device: The client's GPU in Triton's numbering, if it wants GPU memory;
                it gets a CUDA pool there when :attr:`NodeConfig.cuda_pools` allows.
            force_cuda: The client insists on GPU memory (any model, if the node has GPUs).

        Raises:
            UnavailableError: The actor is shutting down, or Triton is restarting
                (at once: a grant never waits on a restart, even for a pool that exists).
            TritonCallError / LayoutError: The model is unknown or cannot use slots.
            CudaError: The GPU region could not be made or registered.
        """
        with self._lock:
            self._refuse_if_retiring()
            self._require_healthy()
            key = self._ensure_pool(model, device, force_cuda)
            grant = self._pools.grant(model, key=key)
        self._pools.reap()  # a pool of the model's older layout, retired above, if idle
        return grant

    # -- users and lifetime ---------------------------------------------------
    def attach(self, user_id: str, pid: int, kind: str = "client", lock: int | None = None) -> NodeInfo:
        """Register a user (a process on this node) of this Triton; returns how to reach it.

        The user counts while it locks byte ``lock`` of :attr:`NodeInfo.users_file`
        (a ``UserLock``); one attached without a lock counts while ``pid`` runs here.

        Raises:
            UnavailableError: The actor is shutting down (its last user left);
                ask again once it is gone and a new one starts. Or the byte is
                not locked (the user locked another actor's users file).
            InputError: ``lock`` is not a byte offset.
        """
        with self._lock:
            self._refuse_if_retiring()
            self._users.attach(user_id, pid, kind, lock)
            return self.info()

    def knows(self, user_id: str) -> bool:
        """Whether ``user_id`` is attached here (``False``: this actor restarted since it attached)."""
        return str(user_id) in self._users

    def detach(self, user_id: str) -> bool:
        """Unregister a user (its ``NodeClient`` closed). Returns whether it was registered."""
        return self._users.detach(user_id)

    def _refuse_if_retiring(self) -> None:
        if self._retiring:
            raise UnavailableError(f"the node actor of {self.node_id} is shutting down (no users left)")

    def _check_users(self) -> None:
        """Forget dead users; retire once the last one has been gone for ``idle_shutdown_s``."""
        self._pools.sweep()
        for user in self._users.reap():
            logger.info(
                "user %s (pid %d, %s) of node %s is gone", user.user_id, user.pid, user.kind, self.node_id
            )
        grace = self.config.idle_shutdown_s
        if grace is None or self._users.idle_for() < grace:
            return
        with self._lock:
            if self._retiring or len(self._users):
                return
            self._retiring = True
        logger.info("node %s: no users for %gs; stopping Triton and exiting", self.node_id, grace)
        self.shutdown()
        # Detached, restartable actors must be killed with no_restart to stay gone.
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def stats(self) -> dict[str, Any]:
        """Triton identity plus per-model slot counts and the users."""
        return {
            "info": dataclasses.asdict(self.info()),
            "pools": self._pools.stats(),
            "users": self._users.snapshot(),
        }

    def report(self, traffic: Sequence[tuple[str, str, int, int]]) -> None:
        """Add a client's traffic sums, ``(model, path, requests, bytes)`` rows (see ``metrics``)."""
        with self._lock:
            for model, path, requests, nbytes in traffic:
                entry = self._traffic.setdefault((str(model), str(path)), [0, 0])
                entry[0] += int(requests)
                entry[1] += int(nbytes)

    def report_door(
        self, user_id: str, stats: dict[str, Any], hold: Sequence[tuple[int, str, str, float]] = ()
    ) -> bool:
        """A replica's front door as it is now: ports, connections, calls (see ``status``).

        ``hold``: the door's fixed ports, as ``(port, app, host, linger_s)`` for
        :meth:`hold_door`; those this actor does not hold (it restarted since the
        replica asked) it holds again.

        Returns:
            Whether ``user_id`` is attached here (``False``: this actor restarted
            since the replica attached, and must not retire for want of users).
        """
        with self._lock:
            self._doors[str(user_id)] = dict(stats)
        for port, app_name, host, linger_s in hold:
            self._held_doors.hold(int(port), str(app_name), str(host), float(linger_s), again=True)
        return self.knows(user_id)

    def hold_door(self, port: int, app_name: str, host: str, linger_s: float) -> bool:
        """Keep the listening socket of ``app_name``'s front door on ``port`` open between its replicas.

        Borrowed from the replica that asks (see ``held_doors``); let go once no
        replica has held it for ``linger_s``, or at :meth:`shutdown`.

        Returns:
            Whether the socket is held.
        """
        return self._held_doors.hold(int(port), str(app_name), str(host), float(linger_s))

    def drop_door(self, port: int, app_name: str) -> None:
        """Let the socket of ``app_name``'s front door on ``port`` go with its last replica (app deleted)."""
        self._held_doors.drop(int(port), str(app_name))

    def status(self) -> dict[str, Any]:
        """What ``ray-triton-shm status`` shows: Triton, its models, pools, traffic by path, the reaper."""
        users = self._users.snapshot()
        attached = {str(u["user"]) for u in users}
        with self._lock:
            traffic = [
                {"model": model, "path": path, "requests": v[0], "bytes": v[1]}
                for (model, path), v in sorted(self._traffic.items())
            ]
            for user_id in set(self._doors) - attached:  # a replica gone: its door with it
                del self._doors[user_id]
            doors = [self._doors[u] for u in sorted(self._doors)]
            grpc = self._grpc
        health = self._health.snapshot()
        try:
            if health["state"] != "ok":  # do not wait on a Triton that does not answer its probe
                raise UnavailableError(f"Triton is {health['state']}", "UNAVAILABLE")
            index = grpc.get_model_repository_index(as_json=True, client_timeout=1.0).get("models", [])
            models = [
                {"name": m.get("name", ""), "version": m.get("version", ""), "state": m.get("state", "")}
                for m in index
            ]
        except InferenceServerException as e:
            models = [{"name": "?", "version": "", "state": f"unavailable: {e.message()}"}]
        except UnavailableError as e:
            models = [{"name": "?", "version": "", "state": f"unavailable: {e.message}"}]
        return {
            "info": dataclasses.asdict(self.info()),
            "health": health,
            "pools": self._pools.stats(),
            "users": users,
            "frontdoors": doors,
            "held_doors": self._held_doors.ports(),
            "idle_shutdown_s": self.config.idle_shutdown_s,
            "reaper": self._reaper.state(),
            "models": models,
            "traffic": traffic,
        }

    def kill_triton(self) -> int:
        """SIGKILL this node's Triton (for fault tests); the health check restarts it.

        Waits for a restart under way (it holds the restart lock), so that the
        pid signalled is the running server's, never one the restart let go of.

        Returns:
            The killed process id.
        """
        with self._restart_lock:
            pid = self._server.pid or -1
            if pid > 0:
                os.kill(pid, 9)
            return pid

    def shutdown(self) -> None:
        """Stop Triton, then unregister and unlink every segment (free GPU regions). Idempotent.

        Triton goes first: once its process is gone nothing can still write
        to a region, so freeing it is safe even if a request was running.
        """
        self._stopping.set()
        with self._lock:
            self._retiring = True
            self._server.stop()
            self._pools.close()
            self._grpc.close()
            self._users.close()
            self._users_file.close()
            self._reaper.close()
            self._held_doors.close()

    # -- server warnings --------------------------------------------------------

    def server_warnings(self) -> list[str]:
        """What ``ray-triton-shm status`` must shout about (e.g. a CPU-only fallback on a GPU node)."""
        return list(self._server.warnings)


def _new_health(config: NodeConfig) -> HealthMonitor:
    return HealthMonitor(
        config.unhealthy_after_s,
        backoff_s=config.restart_backoff_s,
        backoff_max_s=config.restart_backoff_max_s,
    )


def _probe_timeout(config: NodeConfig) -> float:
    """Per-probe timeout: short, so that several probes fit in ``unhealthy_after_s``."""
    return min(2.0, max(0.2, config.unhealthy_after_s / 3))


TritonNodeActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=32)(_NodeActor)
"""The node actor class: ``TritonNodeActor.options(...).remote(NodeConfig)``."""
