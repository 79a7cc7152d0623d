"""Where node actors live and how long: naming, creation on each node, shutdown.

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

from ray_triton_shm._private.node_actor import TritonNodeActor
from ray_triton_shm._private.node_config import _NAME_PREFIX, NAMESPACE, NodeConfig, NodeInfo, actor_name
from ray_triton_shm.errors import RayTritonShmError

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
        name=actor_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": dict(ACTOR_ENV)},
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
