"""Where node actors live and how long: naming, creation on each node, users, shutdown.

A node actor is named by its node and the fingerprint of its
:class:`NodeConfig`, so each config gets its own Triton on each node, and a
changed config (a redeployed app) gets a new one. Users attach to the actor
of their node; once its last user is gone for ``idle_shutdown_s`` it stops
its Triton and exits (see "Lifecycle" in docs/architecture.md).

Example:
    >>> from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors
    >>> ensure_node_actors(NodeConfig.for_repository("deployments/models"))  # doctest: +SKIP
    >>> shutdown_node_actors()                                               # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_triton_shm._private.node.node_actor import TritonNodeActor
from ray_triton_shm._private.node.node_config import (
    NAME_PREFIX,
    NAMESPACE,
    NodeConfig,
    NodeInfo,
    actor_name,
    node_prefix,
)
from ray_triton_shm._private.node.node_registry import UserLock
from ray_triton_shm.errors import RayTritonShmError, SharedMemoryError, UnavailableError

logger = logging.getLogger(__name__)


ACTOR_ENV = {
    # The actor asks for no GPU; Ray must leave CUDA_VISIBLE_DEVICES as the raylet had it (all of the
    # node's GPUs) for the actor and its Triton. Ray 2.49-2.5x blank it for zero-GPU workers unless
    # told not to; older versions honour only the second variable (see docs/cuda.md).
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
}


def _spawn(node_id: str, config: NodeConfig) -> ray.actor.ActorHandle:
    return TritonNodeActor.options(
        name=actor_name(node_id, config),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": dict(ACTOR_ENV)},
    ).remote(config)


def node_actor_names(node_id: str | None = None) -> list[str]:
    """Names of the node actors of ``node_id`` (default: of every node)."""
    prefix = node_prefix(node_id) if node_id else NAME_PREFIX
    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith(prefix)
    )


def get_node_actor(config: NodeConfig | None = None, *, node_id: str | None = None) -> ray.actor.ActorHandle:
    """The node actor that runs ``config`` on ``node_id`` (default: the calling process's node).

    With a config, creates the actor if there is none yet (a node that joined
    after :func:`ensure_node_actors` ran gets its actor this way). Without
    one, returns the node's only actor.

    Raises:
        RayTritonShmError: No config was given and the node has no node
            actor, or several (one per config: name the config).
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    if config is not None:
        return _spawn(node_id, config)
    names = node_actor_names(node_id)
    if len(names) != 1:
        what = "no Triton node actor" if not names else f"{len(names)} Triton node actors (one per config)"
        raise RayTritonShmError(
            f"node {node_id} has {what}; pass the NodeConfig (or call ensure_node_actors(config) first)"
        )
    try:
        return ray.get_actor(names[0], namespace=NAMESPACE)
    except ValueError:
        raise RayTritonShmError(f"the node actor {names[0]} of node {node_id} is gone") from None


def attach(
    config: NodeConfig | None,
    user_id: str,
    pid: int,
    kind: str,
    *,
    lock: UserLock | None = None,
    timeout_s: float = 180.0,
) -> tuple[ray.actor.ActorHandle, NodeInfo]:
    """Register a user with the node actor of its node, starting one if needed.

    With a ``lock``, the user first locks its byte of the actor's users file:
    the actor counts it for as long as it holds that lock.

    An actor that is shutting down (its last user left) refuses; this waits
    until it is gone and starts a new one with ``config``.

    Returns:
        The actor and its :class:`NodeInfo`.

    Raises:
        RayTritonShmError: No actor could be reached within ``timeout_s``.
        ray.exceptions.RayActorError: The actor failed to start Triton.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        actor = get_node_actor(config)
        try:
            offset = None
            if lock is not None:
                users_file = ray.get(actor.info.remote(), timeout=timeout_s).users_file
                if users_file:
                    lock.hold(users_file)
                    offset = lock.offset
            return actor, ray.get(actor.attach.remote(user_id, pid, kind, offset), timeout=timeout_s)
        except (
            UnavailableError,
            SharedMemoryError,  # its users file went with it: the actor is going away
            ray.exceptions.ActorDiedError,
            ray.exceptions.ActorUnavailableError,
        ) as e:
            if time.monotonic() > deadline:
                raise RayTritonShmError(f"no node actor to attach to: {e}") from e
            logger.info("node actor is going away; waiting for a new one (%s)", type(e).__name__)
            time.sleep(0.5)


def ensure_node_actors(config: NodeConfig, *, timeout_s: float = 180.0) -> dict[str, NodeInfo]:
    """Make sure every alive node has a node actor for ``config`` with a ready Triton.

    Call it again (e.g. periodically) to cover nodes the autoscaler added. An
    actor that gets no user within ``config.idle_shutdown_s`` goes away again.

    Returns:
        NodeInfo by node id.

    Raises:
        ray.exceptions.RayActorError: An actor failed to start Triton.
    """
    node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    actors = {node_id: _spawn(node_id, config) for node_id in node_ids}
    infos = ray.get([a.info.remote() for a in actors.values()], timeout=timeout_s)
    return dict(zip(actors, infos))


def shutdown_node_actors(*, node_id: str | None = None, timeout_s: float = 60.0) -> int:
    """Stop node actors now: each stops its Triton, removes its segments and exits.

    Clients still attached fail with :class:`UnavailableError` on their next
    call. What ``ray-triton-shm shutdown`` runs.

    Args:
        node_id: Only this node's actors (default: every node's).
        timeout_s: How long to wait for each actor (a restarting one answers once it is back).

    Returns:
        How many actors were shut down.
    """
    count = 0
    for name in node_actor_names(node_id):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                ray.get(actor.shutdown.remote(), timeout=timeout_s)
                ray.kill(actor, no_restart=True)
                count += 1
                break
            except ValueError:
                break  # already gone
            except ray.exceptions.RayError as e:
                if isinstance(e, ray.exceptions.ActorDiedError) and _gone(name):
                    break
                if time.monotonic() > deadline:
                    logger.warning("could not shut down %s: %s", name, e)
                    break
                time.sleep(0.5)
    return count


def _gone(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True
    return False
