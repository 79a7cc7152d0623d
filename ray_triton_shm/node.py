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

from ray_triton_shm._private.node.node_actor import TritonNodeActor
from ray_triton_shm._private.node.node_client import NodeClient
from ray_triton_shm._private.node.node_config import NAMESPACE, NodeConfig, NodeInfo, actor_name
from ray_triton_shm._private.node.node_lifecycle import (
    ensure_node_actors,
    get_node_actor,
    shutdown_node_actors,
)
from ray_triton_shm._private.node.node_models import runs_on_gpu

__all__ = [
    "NAMESPACE",
    "NodeClient",
    "NodeConfig",
    "NodeInfo",
    "TritonNodeActor",
    "actor_name",
    "ensure_node_actors",
    "get_node_actor",
    "runs_on_gpu",
    "shutdown_node_actors",
]
