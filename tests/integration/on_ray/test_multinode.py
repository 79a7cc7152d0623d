"""Several Ray nodes on one machine, each with its own Triton: every request is served
by the Triton of the replica's own node, through shared memory."""

from __future__ import annotations

import numpy as np
import pytest

from ray_triton_shm import PoolConfig

pytestmark = pytest.mark.slow

REPO_MODELS = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "deployments" / "models")


def _config(**kwargs):
    """A node config serving only ``whoami``: a Triton per node on a small machine, one model each."""
    from ray_triton_shm import ServerConfig
    from ray_triton_shm.node import NodeConfig

    return NodeConfig(server=ServerConfig(model_repository=REPO_MODELS, load_models=("whoami",)), **kwargs)


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's classes by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from .conftest import start_serve_on_a_free_port, teardown_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    start_serve_on_a_free_port()
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

    from ray_triton_shm.node import ensure_node_actors, shutdown_node_actors
    from ray_triton_shm.serve import TritonDeployment

    config = _config(
        pools={"whoami": PoolConfig(slots=4, max_shapes={"INPUT0": (256,), "OUTPUT0": (256,)})},
        # Compared with ensure_node_actors' answer once Serve is up, which a loaded machine may take
        # longer than the default 30 s to be: until then the actors have no user.
        idle_shutdown_s=None,
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
        # Served by the Triton of the node the replica runs on (its runtime node id).
        assert origin["triton_node_id"] == origin["node_id"]
        assert set(outputs["SERVER_PID"].ravel()) == {triton_of_node[origin["node_id"]]}
        seen_nodes.add(origin["node_id"])
    assert seen_nodes == set(triton_of_node), "replicas should be spread over both nodes"
    assert ray.get_runtime_context().get_node_id() in triton_of_node
    serve.delete("multinode")
    shutdown_node_actors()  # kept by idle_shutdown_s=None


def test_a_node_added_after_deploy_serves_through_its_own_triton(two_nodes):
    import ray
    from ray import serve

    from ray_triton_shm.node import get_node_actor
    from ray_triton_shm.serve import TritonDeployment

    config = _config(pools={"whoami": PoolConfig(slots=2, max_shapes={"INPUT0": (64,), "OUTPUT0": (64,)})})
    options = {"max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.1}}
    handle = serve.run(
        TritonDeployment.options(num_replicas=2, **options).bind(config), name="late", route_prefix=None
    )
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    two_nodes.add_node(num_cpus=1)
    two_nodes.wait_for_nodes()
    (late,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
    handle = serve.run(
        TritonDeployment.options(num_replicas=3, **options).bind(config), name="late", route_prefix=None
    )
    seen: dict[str, set[int]] = {}
    for i in range(60):
        x = np.full((1, 64), i, np.float32)
        outputs, origin = handle.infer_with_origin.remote("whoami", {"INPUT0": x}).result(timeout_s=60)
        np.testing.assert_array_equal(outputs["OUTPUT0"], x)
        assert origin["triton_node_id"] == origin["node_id"]
        seen.setdefault(origin["node_id"], set()).update(int(p) for p in outputs["SERVER_PID"].ravel())
        if late in seen and len(seen) == 3:
            break
    assert late in seen, "no request reached the replica on the node added after deploy"
    # The late node got its own node actor (made by the replica that landed there), and its Triton served.
    late_info = ray.get(get_node_actor(config, node_id=late).info.remote())
    assert seen[late] == {late_info.triton_pid}
    assert len({pid for pids in seen.values() for pid in pids}) == len(seen)
    serve.delete("late")


class _Where:
    """A whoami predictor that also records where its worker ran and which node's Triton it used."""

    def __init__(self, config) -> None:
        from ray_triton_shm.data import TritonPredictor

        self._predict = TritonPredictor(model="whoami", node_config=config, input_columns={"INPUT0": "data"})

    def __call__(self, batch):
        import ray

        out = self._predict(batch)
        rows = len(out["data"])
        out["RUNTIME_NODE"] = np.array([ray.get_runtime_context().get_node_id()] * rows)
        out["TRITON_NODE"] = np.array([self._predict._client.info.node_id] * rows)
        return out


def test_ray_data_workers_use_the_triton_of_their_own_node(two_nodes):
    import ray

    from ray_triton_shm.node import ensure_node_actors

    config = _config(
        idle_shutdown_s=None,  # compared with ensure_node_actors' answer after the job
        pools={"whoami": PoolConfig(slots=2, max_shapes={"INPUT0": (32,), "OUTPUT0": (32,)})},
    )
    infos = ensure_node_actors(config)
    rows = 400
    # One stage only: its two workers take 0.6 of a node's one CPU each, so one lands on each node.
    data = np.arange(rows * 32, dtype=np.float32).reshape(rows, 32)
    # Both workers up before the first block is handed out: a pool that starts its actors one by
    # one can give every block to the first while the second still starts.
    context = ray.data.DataContext.get_current()
    waited = context.wait_for_min_actors_s
    context.wait_for_min_actors_s = 300
    try:
        ds = ray.data.from_numpy(np.split(data, 10))  # ten blocks, so both workers get some
        out = ds.map_batches(
            _Where,
            fn_constructor_kwargs={"config": config},
            compute=ray.data.ActorPoolStrategy(size=2),
            num_cpus=0.6,  # one worker per node: each node has one CPU
            batch_size=20,
            batch_format="numpy",
            scheduling_strategy="SPREAD",
        ).take_all()
    finally:
        context.wait_for_min_actors_s = waited
    assert len(out) == rows
    nodes = set()
    for row in out:
        assert row["RUNTIME_NODE"] == row["TRITON_NODE"]
        assert int(row["SERVER_PID"][0]) == infos[row["RUNTIME_NODE"]].triton_pid
        np.testing.assert_array_equal(row["OUTPUT0"], row["data"])
        nodes.add(row["RUNTIME_NODE"])
    assert len(nodes) == 2, f"the workers ran on {len(nodes)} node(s); the test needs both"
