"""What the cluster says of itself, from one host: nodes, node actors, Serve replicas, as one JSON object.

Run inside a host (a Ray driver). ``nodes``: every node Ray knows (id,
address, alive); ``node_actors`` and ``replicas``: the live-or-pending actors
of ``TritonNodeActor`` and of the app's Serve replicas (id, state, node), from
Ray's state API.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    """Print the view."""
    import ray
    from ray.util.state import list_actors

    ray.init(address="auto", log_to_driver=False)
    nodes = [
        {"id": n["NodeID"], "address": n["NodeManagerAddress"], "alive": bool(n["Alive"])}
        for n in ray.nodes()
    ]
    actors = list_actors(filters=[("state", "!=", "DEAD")], limit=10000, raise_on_missing_output=False)

    def of(word: str) -> list[dict]:
        return [
            {"id": a.actor_id, "state": a.state, "node": a.node_id, "pid": a.pid, "class": a.class_name}
            for a in actors
            if word in (a.class_name or "")
        ]

    view = {"nodes": nodes, "node_actors": of("_NodeActor"), "replicas": of("ServeReplica:triton")}
    ray.shutdown()
    print(json.dumps(view), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
