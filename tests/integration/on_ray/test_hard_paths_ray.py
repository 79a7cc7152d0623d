"""The hardest paths through the node actor, for real (docs/reliability.md, cases 12 to 15):
Triton killed while a NodeClient's requests hold leases, a NodeClient closed while
another thread is inside ``infer()``, a zero-copy view outliving its NodeClient,
and the shipped size switch (no ``MIN_SHM_BYTES`` override) through NodeClient,
Serve and Ray Data.

Ray is started with ``RAY_TRITON_SHM_MIN_SHM_BYTES`` unset, so the node actor,
Serve replicas and Data workers run with the shipped defaults; the tests that
need shared memory for tiny tensors set it in this process only.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_triton_shm import PoolClosedError, PoolConfig, RayTritonShmError, ServerConfig
from ray_triton_shm.config import GRPC_MIN_SHM_BYTES

pytestmark = pytest.mark.slow

REPO_MODELS = str(Path(__file__).resolve().parents[3] / "deployments" / "models")
ENV = "RAY_TRITON_SHM_MIN_SHM_BYTES"


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's classes by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def affine(x: np.ndarray) -> np.ndarray:
    return (np.float32(1) - np.float32(2) * x).astype(np.float32)


@pytest.fixture(scope="module")
def node():
    from ray_triton_shm.node import NodeConfig, ensure_node_actors, get_node_actor

    from .conftest import local_ray

    saved = os.environ.pop(ENV, None)  # Ray's workers inherit the shipped default
    config = NodeConfig(
        # Only the models called through this node (its Triton is killed and restarted here).
        server=ServerConfig(model_repository=REPO_MODELS, load_models=("affine", "sleep")),
        quarantine_s=1.0,
        health_interval_s=0.2,
        idle_shutdown_s=None,  # the module holds the actor's handle across tests
        pools={
            "sleep": PoolConfig(slots=4),
            "affine": PoolConfig(
                slots=2, max_batch_size=1, max_shapes={"INPUT0": (1 << 16,), "OUTPUT0": (1 << 16,)}
            ),
        },
    )
    try:
        with local_ray():
            ensure_node_actors(config)
            yield config, get_node_actor()
    finally:
        if saved is not None:
            os.environ[ENV] = saved


@pytest.fixture
def tiny_over_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """NodeClients made in this process send even tiny tensors through shared memory."""
    monkeypatch.setenv(ENV, "0")


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.01)


def call_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def pool_stats(actor, model: str) -> dict[str, int]:
    import ray

    return ray.get(actor.stats.remote())["pools"][model]


def _regions_in_triton(actor_self: Any) -> list[str]:
    """Run inside the node actor: the regions its Triton has registered (it holds the shm key)."""
    status = actor_self._grpc.get_system_shared_memory_status(
        headers=actor_self._server.shm_api_headers, as_json=True
    )
    return [region["name"] for region in status.get("regions", {}).values()]


def node_regions(actor) -> list[str]:
    import ray

    return ray.get(actor.__ray_call__.remote(_regions_in_triton))


def sleep_input(seconds: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full((1, 1), seconds, np.float32)}


# -- case 12: Triton killed while a NodeClient's requests hold leases ----------------------


def test_triton_killed_while_node_client_requests_hold_leases(node, tiny_over_shm) -> None:
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    before = ray.get(actor.info.remote())
    with NodeClient(config, slots_per_model=4, request_timeout_s=60) as client:
        client.infer("sleep", sleep_input(0.0))
        pool = client.client.pool("sleep")
        calls = [
            call_in_thread(lambda i=i: client.infer("sleep", sleep_input(3.0 + i / 1000))) for i in range(4)
        ]
        wait_for(lambda: pool.stats().busy == 4, what="four leases held")
        ray.get(actor.kill_triton.remote())
        for thread, _ in calls:
            thread.join(timeout=90)
            assert not thread.is_alive(), "a request hung after Triton died"
        for i, (_, box) in enumerate(calls):
            if "error" in box:
                assert isinstance(box["error"], RayTritonShmError), repr(box["error"])
            else:
                np.testing.assert_allclose(box["result"]["OUTPUT0"], [[3.0 + i / 1000]], rtol=1e-6)
        assert any("error" in box for _, box in calls), "killing Triton failed none of the requests"
        assert pool.stats().busy == 0
        # The actor restarts Triton and registers its regions again; the client reconnects.
        wait_for(lambda: ray.get(actor.info.remote()).epoch > before.epoch, what="Triton restarted")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.infer("sleep", sleep_input(0.0))
                break
            except RayTritonShmError:
                assert time.monotonic() < deadline, "the client never got going again"
                time.sleep(0.2)
        # (The client need not reconnect: the restarted Triton keeps its ports, and the actor
        # registered the node's regions in it again.)
        after = ray.get(actor.info.remote())
        assert after.triton_pid != before.triton_pid
        region = client.client.pool("sleep").region_name
        assert region in node_regions(actor), "the node's region was not registered again"
        again = [
            call_in_thread(lambda i=i: client.infer("sleep", sleep_input(0.2 + i / 1000))) for i in range(4)
        ]
        for i, (thread, box) in enumerate(again):
            thread.join(timeout=60)
            assert "error" not in box, repr(box.get("error"))
            assert box["result"].path == "shm"
            np.testing.assert_allclose(box["result"]["OUTPUT0"], [[0.2 + i / 1000]], rtol=1e-6)
    wait_for(lambda: pool_stats(actor, "sleep")["in_use"] == 0, what="every slot back")


# -- case 13: NodeClient.close() while another thread is inside infer() ----------------------


def test_node_client_closed_while_another_thread_is_inside_infer(node, tiny_over_shm) -> None:
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    client = NodeClient(config, slots_per_model=1, request_timeout_s=60)
    client.infer("sleep", sleep_input(0.0))
    pool = client.client.pool("sleep")
    instance = ray.get(actor.info.remote()).instance_id
    thread, box = call_in_thread(lambda: client.infer("sleep", sleep_input(1.5)))
    wait_for(lambda: pool.stats().busy == 1, what="the request's lease")
    client.close()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request hung after close()"
    if "error" in box:
        # Typed: not a KeyError from a freed slot, and the client did not reconnect behind our back.
        assert isinstance(box["error"], RayTritonShmError), repr(box["error"])
    else:
        np.testing.assert_allclose(box["result"]["OUTPUT0"], [[1.5]])
    with pytest.raises(PoolClosedError):
        client.infer("sleep", sleep_input(0.0))
    assert ray.get(actor.info.remote()).instance_id == instance
    wait_for(lambda: pool_stats(actor, "sleep")["in_use"] == 0, what="the slot back")


# -- case 14: a zero-copy view outliving its NodeClient ----------------------------------------


def test_view_outliving_its_node_client_keeps_its_values(node, tiny_over_shm) -> None:
    from ray_triton_shm.node import NodeClient

    config, actor = node
    x = np.random.default_rng(41).standard_normal((1, 4096), dtype=np.float32)
    first = NodeClient(config, slots_per_model=2)  # every slot of the node's affine pool
    view = first.infer("affine", {"INPUT0": x}, copy=False)["OUTPUT0"]
    assert not view.flags.owndata
    first.close()
    # The viewed slot stays held while the view lives; the other one is free for the next client.
    wait_for(lambda: pool_stats(actor, "affine")["in_use"] == 1, what="only the viewed slot held")
    # The next client writes its own answers into the node's slots.
    with NodeClient(config, slots_per_model=2) as second:
        for seed in range(4):
            y = np.full((1, 4096), float(seed + 10), np.float32)
            np.testing.assert_array_equal(second.infer("affine", {"INPUT0": y})["OUTPUT0"], affine(y))
        assert sorted(second.client.pool("affine").slot_indices) == [0, 1]
    np.testing.assert_array_equal(view, affine(x))


# -- case 15: the shipped size switch (no override) ---------------------------------------------


def test_node_client_with_the_shipped_switch_sends_every_size_through_shm(node) -> None:
    """Node clients send shm requests over HTTP, whose shipped crossover is 0 bytes."""
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    assert ENV not in os.environ
    small = np.arange(16, dtype=np.float32).reshape(1, 16)  # 64 bytes
    large = np.arange(1 << 15, dtype=np.float32).reshape(1, 1 << 15)  # 128 KiB
    with NodeClient(config, slots_per_model=1) as client:
        assert client.client.config.pool_for("affine").min_shm_bytes is None
        for x in (small, large):
            result = client.infer("affine", {"INPUT0": x})
            assert result.path == "shm"
            np.testing.assert_array_equal(result["OUTPUT0"], affine(x))
        client.flush_reports()

    def traffic() -> dict[str, int]:
        rows = ray.get(actor.status.remote())["traffic"]
        return {row["path"]: row["requests"] for row in rows if row["model"] == "affine"}

    wait_for(lambda: traffic().get("shm", 0) >= 2, what="the node's traffic count")
    assert "grpc" not in traffic()


def test_node_client_switch_set_to_64_kib_splits_by_size(node) -> None:
    """The gRPC transport's shipped crossover (64 KiB), asked of a node client: both sides of it."""
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    # Client-side pool settings: the same node actor (and its traffic counts) serves this config.
    affine_pool = dataclasses.replace(config.pools["affine"], min_shm_bytes=GRPC_MIN_SHM_BYTES)
    config = dataclasses.replace(config, pools={**config.pools, "affine": affine_pool})
    below = np.ones((1, GRPC_MIN_SHM_BYTES // 4 - 1), np.float32)
    at = np.ones((1, GRPC_MIN_SHM_BYTES // 4), np.float32)
    rows = ray.get(actor.status.remote())["traffic"]
    start = {row["path"]: row["requests"] for row in rows if row["model"] == "affine"}
    with NodeClient(config, slots_per_model=1) as client:
        small, large = client.infer("affine", {"INPUT0": below}), client.infer("affine", {"INPUT0": at})
        assert (small.path, large.path) == ("grpc", "shm")
        np.testing.assert_array_equal(small["OUTPUT0"], affine(below))
        np.testing.assert_array_equal(large["OUTPUT0"], affine(at))
        client.flush_reports()

    def grew() -> bool:
        rows = ray.get(actor.status.remote())["traffic"]
        now = {row["path"]: row["requests"] for row in rows if row["model"] == "affine"}
        return all(now.get(p, 0) >= start.get(p, 0) + 1 for p in ("grpc", "shm"))

    wait_for(grew, what="one request on each path in the node's traffic")


def test_serve_with_the_shipped_switch(node) -> None:
    from ray import serve

    from ray_triton_shm.serve import build_app

    from .conftest import start_serve_on_a_free_port

    args = {
        "model_repository": REPO_MODELS,
        "slots_per_model": 1,
        "pools": {
            "affine": {
                "slots": 2,
                "max_batch_size": 1,
                "max_shapes": {"INPUT0": [1 << 16], "OUTPUT0": [1 << 16]},
            }
        },
    }
    start_serve_on_a_free_port()
    handle = serve.run(build_app(args, {"num_replicas": 1}), name="switch", route_prefix="/switch")
    try:
        for n in (16, 1 << 15):  # 64 bytes and 128 KiB
            x = np.random.default_rng(n).standard_normal((1, n), dtype=np.float32)
            outputs, origin = handle.infer_with_origin.remote("affine", {"INPUT0": x}).result(timeout_s=120)
            # The replica's node client sends shm requests over HTTP: shipped crossover 0 bytes.
            assert origin["path"] == "shm", origin
            np.testing.assert_array_equal(outputs["OUTPUT0"], affine(x))
    finally:
        serve.delete("switch")


def test_ray_data_with_the_shipped_switch(node) -> None:
    import ray

    from ray_triton_shm.data import TritonPredictor

    config, actor = node

    def shm_requests() -> int:
        rows = ray.get(actor.status.remote())["traffic"]
        return sum(r["requests"] for r in rows if r["model"] == "affine" and r["path"] == "shm")

    def grpc_requests() -> int:
        rows = ray.get(actor.status.remote())["traffic"]
        return sum(r["requests"] for r in rows if r["model"] == "affine" and r["path"] == "grpc")

    rows = 8
    for n in (16, 1 << 15):  # 64 bytes and 128 KiB a row
        shm_before, grpc_before = shm_requests(), grpc_requests()
        x = np.random.default_rng(n).standard_normal((rows, n), dtype=np.float32)
        ds = ray.data.from_items([{"INPUT0": row} for row in x])
        out = ds.map_batches(
            TritonPredictor,
            fn_constructor_kwargs={"model": "affine", "slots_per_model": 1, "node_config": config},
            batch_size=1,
            concurrency=1,
        ).take_all()
        assert len(out) == rows
        for row in out:
            np.testing.assert_array_equal(row["OUTPUT0"], affine(np.asarray(row["INPUT0"])))
        # Every batch went through shared memory (HTTP transport: shipped crossover 0 bytes).
        wait_for(lambda want=shm_before + rows: shm_requests() >= want, what="the worker's traffic reports")
        assert grpc_requests() == grpc_before
