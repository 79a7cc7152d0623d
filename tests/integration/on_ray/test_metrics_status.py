"""Metrics on Ray's Prometheus endpoint, and ``ray-triton-shm status``, on a real Ray and Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import InputError, PoolConfig
from tests.helpers import metric_value, scrape_prometheus

from .conftest import free_port, init_ray

REPO_MODELS = str(Path(__file__).resolve().parents[3] / "deployments" / "models")
SHM_CALLS, GRPC_CALLS, BAD_CALLS = 5, 3, 2
# add_sub: two int32 inputs and two int32 outputs of shape (2, 16).
ADD_SUB_BYTES = 4 * 2 * 16 * 4


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's tasks by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def cluster():
    """Local Ray exporting metrics on a free port, with a node actor; yields (address, metrics port)."""
    import ray

    from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors

    port = free_port()
    info = init_ray(port)
    try:
        config = NodeConfig.for_repository(
            REPO_MODELS, health_interval_s=0.2, idle_shutdown_s=None, pools={"add_sub": PoolConfig(slots=3)}
        )
        ensure_node_actors(config)
        yield info.address_info["gcs_address"], port
    finally:
        shutdown_node_actors()
        ray.shutdown()


def _traffic_task() -> dict[str, str]:
    """In a Ray worker: shm calls, gRPC calls and bad calls through the node's Triton."""
    from ray_triton_shm.node import NodeClient

    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    errors = {}
    with NodeClient() as client:
        for _ in range(SHM_CALLS):
            out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
            assert out.path == "shm"
            np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
        for _ in range(GRPC_CALLS):
            out = client.infer_grpc("add_sub", {"INPUT0": a, "INPUT1": a})
            np.testing.assert_array_equal(out["OUTPUT1"], 0 * a)
        for _ in range(BAD_CALLS):
            try:
                client.infer("add_sub", {"INPUT0": a.astype(np.float32), "INPUT1": a})
            except InputError as e:
                errors[type(e).__name__] = str(e)
    return errors


def test_metrics_reach_prometheus_and_status_counts_traffic(cluster):
    import ray

    from ray_triton_shm._private.cli import status
    from ray_triton_shm.node import get_node_actor

    address, port = cluster
    errors = ray.get(ray.remote(num_cpus=0)(_traffic_task).remote(), timeout=120)
    assert set(errors) == {"InputError"}
    actor = get_node_actor()
    killed = ray.get(actor.kill_triton.remote())
    assert killed > 0

    want = {
        ("ray_triton_shm_requests_total", ("add_sub", "shm")): SHM_CALLS,
        ("ray_triton_shm_requests_total", ("add_sub", "grpc")): GRPC_CALLS,
        ("ray_triton_shm_bytes_total", ("add_sub", "shm")): SHM_CALLS * ADD_SUB_BYTES,
        ("ray_triton_shm_bytes_total", ("add_sub", "grpc")): GRPC_CALLS * ADD_SUB_BYTES,
    }
    # Triton's restart may take up to its startup_timeout_s (120 s) on a loaded machine.
    deadline = time.monotonic() + 150
    while True:
        samples = scrape_prometheus(port)
        got = {key: metric_value(samples, key[0], model=key[1][0], path=key[1][1]) for key in want}
        errors_seen = metric_value(samples, "ray_triton_shm_errors_total", model="add_sub", type="InputError")
        waits = metric_value(samples, "ray_triton_shm_lease_wait_seconds_count", model="add_sub")
        slots = metric_value(samples, "ray_triton_shm_pool_slots", model="add_sub")
        utilization = metric_value(samples, "ray_triton_shm_pool_utilization", model="add_sub")
        restarts = metric_value(samples, "ray_triton_shm_triton_restarts_total")
        complete = (
            got == want
            and errors_seen == BAD_CALLS
            and waits == SHM_CALLS
            and slots == 3
            and utilization is not None
            and restarts == 1
        )
        if complete:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"metrics incomplete: {got} (want {want}), errors {errors_seen}, lease waits {waits}, "
                f"slots {slots}, utilization {utilization}, restarts {restarts}; "
                f"the node's health: {ray.get(actor.status.remote(), timeout=30)['health']}"
            )
        time.sleep(1.0)
    seconds = metric_value(samples, "ray_triton_shm_request_seconds_count", model="add_sub", path="shm")
    assert seconds == SHM_CALLS

    # status: the client closed, so its last traffic report has been sent.
    nodes = status.collect()
    assert len(nodes) == 1 and "error" not in nodes[0]
    node = nodes[0]
    traffic = {(t["model"], t["path"]): (t["requests"], t["bytes"]) for t in node["traffic"]}
    assert traffic == {
        ("add_sub", "shm"): (SHM_CALLS, SHM_CALLS * ADD_SUB_BYTES),
        ("add_sub", "grpc"): (GRPC_CALLS, GRPC_CALLS * ADD_SUB_BYTES),
    }
    assert node["info"]["restarts"] == 1
    assert node["pools"]["add_sub"]["slots"] == 3
    assert node["pools"]["add_sub"]["free"] == 3  # the task's grant came back when it closed
    assert {"add_sub", "identity", "multi_io"} <= {m["name"] for m in node["models"] if m["state"] == "READY"}
    text = status.render(nodes)
    assert "add_sub" in text and "restarts 1" in text and node["info"]["version"] in text

    # The command line, from another process, against this cluster's explicit address.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cli = [sys.executable, "-m", "ray_triton_shm", "status", "--address", address]
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout)
    assert [n["node_id"] for n in parsed] == [node["node_id"]]
    assert {(t["model"], t["path"]): t["requests"] for t in parsed[0]["traffic"]} == {
        ("add_sub", "shm"): SHM_CALLS,
        ("add_sub", "grpc"): GRPC_CALLS,
    }
    table = subprocess.run(cli, capture_output=True, text=True, timeout=120, env=env)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "pool" in table.stdout and "bytes moved" in table.stdout and "1 node(s)" in table.stdout
