"""Slot references on two Ray nodes (one machine, a Triton per node): local routing and the array fallback.

One replica of the Serve app per node; the caller is this driver, on the head
node. With local routing every reference goes to the head's replica and runs
in the slot; without it, calls that reach the other node's replica come back
through the array fallback, with correct outputs either way.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from .conftest import free_port

pytestmark = pytest.mark.slow

ARGS = {
    "model_repository": "examples",
    "quarantine_s": 1.0,
    "server": {"load_models": ["affine"]},  # two Tritons on a small machine: one model each
    "pools": {
        "affine": {"slots": 4, "max_batch_size": 1, "max_shapes": {"INPUT0": [1024], "OUTPUT0": [1024]}}
    },
}


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{pid}_")]


@pytest.fixture(scope="module")
def spread_app():
    """(handle, node actor pids by node id): the app with one replica on each of two nodes."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from ray_triton_shm.node import NodeConfig, ensure_node_actors
    from ray_triton_shm.serve import TritonDeployment

    from .conftest import teardown_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    pids: list[int] = []
    try:
        config = NodeConfig.from_args(**ARGS)
        infos = ensure_node_actors(config)
        assert len(infos) == 2
        pids = [info.actor_pid for info in infos.values()]
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        app = TritonDeployment.options(
            num_replicas=2, max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.1}
        ).bind(config, None, "system")
        handle = serve.run(app, name="refs-spread", route_prefix=None)
        yield handle, infos
    finally:
        try:
            teardown_ray()
        finally:
            cluster.shutdown()
    deadline = time.monotonic() + 60
    while any(_segments(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [s for pid in pids for s in _segments(pid)], "segments left in /dev/shm"


def test_local_routing_sends_every_ref_to_this_nodes_replica(spread_app) -> None:
    import ray

    from ray_triton_shm.serve import SlotRefCaller

    handle, _ = spread_app
    here = ray.get_runtime_context().get_node_id()
    with SlotRefCaller(handle, args=ARGS) as caller:
        for i in range(20):
            x = np.full((1, 100 + i), float(i), np.float32)
            with caller.lease("affine") as lease:
                assert lease.in_slot
                lease.input("INPUT0", x.shape)[...] = x
                out = caller.run(lease)
                assert out.path == "slot_ref"
                np.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)
                assert lease.served_by["node_id"] == here
                del out


def test_calls_reaching_the_other_node_fall_back_to_arrays(spread_app) -> None:
    from ray_triton_shm.serve import SlotRefCaller

    handle, _ = spread_app
    paths = []
    with SlotRefCaller(handle, args=ARGS, prefer_local=False) as caller:
        for i in range(40):
            x = np.full((1, 64), float(i), np.float32)
            with caller.lease("affine") as lease:
                lease.input("INPUT0", x.shape)[...] = x
                out = caller.run(lease)
                np.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)
                paths.append(out.path)
                del out
        for stats in caller.node_client().client.pool_stats():
            assert stats.busy == stats.pinned == stats.quarantined == 0, stats
    # Random routing over two replicas: both ways, 40 times (2**-40 odds of one way only).
    assert set(paths) == {"slot_ref", "handle"}, paths
