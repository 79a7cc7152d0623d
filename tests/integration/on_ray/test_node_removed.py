"""Case 8: a node removed from a multi-node ``ray.cluster_utils.Cluster`` while it serves.

Its node actor, Triton and Serve replica go with it; the other node keeps serving,
Serve replaces the lost replica there, and the removed node's segments are swept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import PoolConfig, ServerConfig
from tests.helpers import pid_alive

pytestmark = pytest.mark.slow

REPO_MODELS = str(Path(__file__).resolve().parents[3] / "deployments" / "models")


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's functions by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from .conftest import start_serve_on_a_free_port, teardown_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    start_serve_on_a_free_port()
    try:
        yield cluster
    finally:
        try:
            teardown_ray()
        finally:
            cluster.shutdown()


def test_removed_node_stops_serving_and_the_rest_carries_on(cluster):
    import ray
    from ray import serve

    from ray_triton_shm._private.shm import segment, sweep
    from ray_triton_shm.node import NodeConfig, ensure_node_actors, get_node_actor
    from ray_triton_shm.serve import TritonDeployment

    worker = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    config = NodeConfig(
        # Only the model called here: a Triton per node on a small machine, one model each.
        server=ServerConfig(model_repository=str(REPO_MODELS), load_models=("whoami",)),
        quarantine_s=1.0,
        pools={"whoami": PoolConfig(slots=4, max_shapes={"INPUT0": (64,), "OUTPUT0": (64,)})},
        idle_shutdown_s=None,  # compared with ensure_node_actors' answer once Serve is up (slow when loaded)
    )
    infos = ensure_node_actors(config)
    assert len(infos) == 2
    head_id = ray.get_runtime_context().get_node_id()
    (worker_id,) = [n for n in infos if n != head_id]
    doomed_triton = infos[worker_id].triton_pid
    doomed_actor = ray.get(get_node_actor(node_id=worker_id).__ray_call__.remote(lambda self: os.getpid()))

    app = TritonDeployment.options(
        num_replicas=2, max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.1}
    ).bind(config, 1)
    handle = serve.run(app, name="removal", route_prefix=None)

    def call(i: int) -> dict:
        x = np.full((1, 64), i, np.float32)
        outputs, origin = handle.infer_with_origin.remote("whoami", {"INPUT0": x}).result(timeout_s=60)
        np.testing.assert_array_equal(outputs["OUTPUT0"], x)
        assert set(outputs["SERVER_PID"].ravel()) == {infos[origin["node_id"]].triton_pid}
        return origin

    assert {call(i)["node_id"] for i in range(30)} == {head_id, worker_id}

    prefix = f"{segment.SEGMENT_PREFIX}_{doomed_actor}_"
    assert sweep.list_segments(prefix), "the worker's node actor should own segments"
    cluster.remove_node(worker)
    deadline = time.monotonic() + 60
    while pid_alive(doomed_triton) or pid_alive(doomed_actor):
        assert time.monotonic() < deadline, "the removed node's actor or Triton outlived its node"
        time.sleep(0.2)

    # Requests keep being answered, correctly, by the head node once Serve notices.
    errors: list[Exception] = []
    answered_by = []
    deadline = time.monotonic() + 90
    while len(answered_by) < 20:
        assert time.monotonic() < deadline, f"service did not recover; errors: {errors[-3:]}"
        try:
            answered_by.append(call(1000 + len(answered_by))["node_id"])
        except Exception as e:  # requests routed to the dead replica fail; they must not hang
            errors.append(e)
            time.sleep(0.5)
    assert set(answered_by) == {head_id}

    # The removed node's segments went with its node actor (its reaper removed them).
    deadline = time.monotonic() + 30
    while sweep.list_segments(prefix):
        assert time.monotonic() < deadline, f"left behind: {sweep.list_segments(prefix)}"
        time.sleep(0.2)
