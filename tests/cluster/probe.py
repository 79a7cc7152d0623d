"""Locality from one host: a client of its own node's Triton works, one pointed at another host's fails.

Run inside a host (a Ray driver on the host's own node). With the Serve app's
args (``--config``, a Serve config file), it

* calls ``add_sub`` through a :class:`~ray_triton_shm.node.NodeClient` of its own
  node (the same node actor the app's replicas use) and checks every value;
* then builds a client exactly as a ``NodeClient`` does, but on the node actor of
  ``--foreign`` (another host's node id): the actor grants that host's pool, and
  attaching its segment here fails (the segment is in the other host's /dev/shm);
  and it asks the other host's Triton address (loopback there) for its health.

Prints one JSON object: its node id, the own call's outcome and Triton pid, and
the foreign attempt's error type and message.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from collections.abc import Sequence

import numpy as np
import yaml


def main(argv: Sequence[str] | None = None) -> int:
    """Run the probe; print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--foreign", required=True, help="another host's Ray node id")
    args = parser.parse_args(argv)

    import ray

    from ray_triton_shm import ClientConfig, TritonShmClient
    from ray_triton_shm._private.node.granted_pools import GrantedPools
    from ray_triton_shm._private.node.node_config import split_app_args
    from ray_triton_shm.node import NodeClient, get_node_actor

    spec = yaml.safe_load(open(args.config))
    # The app's node settings, as the Serve app reads them (its front door is the replicas' own).
    node_args = {k: v for k, v in spec["applications"][0]["args"].items() if k != "frontdoor"}
    config, _ = split_app_args(node_args)
    ray.init(address="auto", log_to_driver=False)
    here = ray.get_runtime_context().get_node_id()
    a = np.arange(16, dtype=np.int32).reshape(1, 16) + 7000
    b = np.full((1, 16), 3, np.int32)
    result: dict = {"node_id": here}

    with NodeClient(config) as client:
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        result["own"] = {
            "path": out.path,
            "correct": bool(np.array_equal(out["OUTPUT0"], a + b) and np.array_equal(out["OUTPUT1"], a - b)),
            "triton_node_id": client.info.node_id,
            "http_url": client.info.http_url,
        }

    actor = get_node_actor(config, node_id=args.foreign)
    info = ray.get(actor.info.remote(), timeout=60)
    result["foreign_info"] = {"node_id": info.node_id, "http_url": info.http_url}
    client_config = ClientConfig(url=info.grpc_url, http_url=info.http_url, pools=dict(config.pools))
    foreign = TritonShmClient(client_config, pool_source=GrantedPools(actor, None, info))
    try:
        out = foreign.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        result["foreign"] = {"error_type": None, "error": None, "path": out.path}
    except Exception as e:
        result["foreign"] = {"error_type": type(e).__name__, "error": str(e)[:500]}
    finally:
        try:
            foreign.close()
        except Exception as e:  # the pools never attached: nothing of them to close
            result["foreign_close"] = f"{type(e).__name__}: {e}"[:300]
    try:
        with urllib.request.urlopen(f"http://{info.http_url}/v2/health/ready", timeout=5) as answer:
            result["foreign_triton"] = f"answered {answer.status}"
    except Exception as e:
        result["foreign_triton"] = f"{type(e).__name__}: {e}"[:300]
    ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
