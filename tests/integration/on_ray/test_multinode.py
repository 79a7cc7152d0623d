"""Several Ray nodes on one machine, each with its own Triton: every request is served
by the Triton of the replica's own node, through shared memory."""

from __future__ import annotations

import numpy as np
import pytest

from ray_triton_shm import PoolConfig

pytestmark = pytest.mark.slow

REPO_MODELS = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "deployments" / "models")


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from .conftest import teardown_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        try:
            teardown_ray()
        finally:
            cluster.shutdown()


def test_each_replica_uses_the_triton_of_its_own_node(two_nodes):
    import ray
    from ray import serve

    from ray_triton_shm.node import NodeConfig, ensure_node_actors
    from ray_triton_shm.serve import TritonDeployment

    config = NodeConfig.for_repository(
        REPO_MODELS, pools={"whoami": PoolConfig(slots=4, max_shapes={"INPUT0": (256,), "OUTPUT0": (256,)})}
    )
    infos = ensure_node_actors(config)
    assert len(infos) == 2
    triton_of_node = {node_id: info.triton_pid for node_id, info in infos.items()}
    assert len(set(triton_of_node.values())) == 2, "each node must run its own Triton"

    app = TritonDeployment.options(
        num_replicas=2, max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.1}
    ).bind(config, 1)
    handle = serve.run(app, name="multinode", route_prefix=None)
    seen_nodes = set()
    for i in range(40):
        x = np.full((2, 256), i, np.float32)
        outputs, origin = handle.infer_with_origin.remote("whoami", {"INPUT0": x}).result()
        np.testing.assert_array_equal(outputs["OUTPUT0"], x)
        assert origin["path"] == "shm"
        # Served by the Triton of the replica's own node, not another one.
        assert set(outputs["SERVER_PID"].ravel()) == {triton_of_node[origin["node_id"]]}
        seen_nodes.add(origin["node_id"])
    assert seen_nodes == set(triton_of_node), "replicas should be spread over both nodes"
    assert ray.get_runtime_context().get_node_id() in triton_of_node
