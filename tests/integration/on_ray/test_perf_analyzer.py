"""Triton's own perf_analyzer, unchanged, against the app's front door over HTTP and gRPC.

deployments/triton_shm.yaml (two replicas, the front door on free ports), a local
Ray and the node's real Triton. perf_analyzer (``make peers`` installs it in
.cache/peers) sends 4 MB tensors with 8 requests in flight for a few count
windows per protocol: it must exit 0 and report no error, measure some
throughput, and Triton must have served at least what it counted. After the app
is shut down nothing of it is left in /dev/shm.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
import yaml

from ray_triton_shm._private.bench import cpu_share
from ray_triton_shm._private.bench import perf_analyzer as pa

from .conftest import config_copy, local_ray

CALLERS = 8
ELEMENTS = 1024 * 1024  # 4 MB of FP32 per request


@pytest.fixture(scope="module")
def binary():
    try:
        return pa.find_binary()
    except pa.PerfAnalyzerMissingError as e:
        pytest.fail(f"{e} (make test installs it)")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app's front door (HTTP, gRPC), a replica's whereami, the replicas' pids."""
    from ray_triton_shm.serve import run_config_file

    path, _ = config_copy(tmp_path_factory.mktemp("pa"), quarantine_s=1.0)
    door = yaml.safe_load(path.read_text())["applications"][0]["args"]["frontdoor"]
    with local_ray():
        handle = run_config_file(str(path))["triton"]
        where = handle.whereami.remote().result()
        # This run's replicas: the processes below this one that Ray runs them in.
        replicas = [p for p, (_, what) in cpu_share.snapshot(os.getpid()).items() if "ServeReplica" in what]
        assert where["pid"] in replicas
        yield {
            "replicas": replicas,
            "handle": handle,
            "http": f"127.0.0.1:{door['http_port']}",
            "grpc": f"127.0.0.1:{door['grpc_port']}",
            "where": where,
        }


def _served(triton_http: str) -> int:
    client = httpclient.InferenceServerClient(triton_http)
    try:
        stats = client.get_inference_statistics("identity")
        return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_unchanged_against_the_front_door(app, binary, protocol, tmp_path) -> None:
    x = np.random.default_rng(7).random(ELEMENTS, dtype=np.float32)
    spec = pa.PerfAnalyzerRun(
        protocol=protocol,
        url=app[protocol],
        model="identity",
        input_data=pa.write_input_data(tmp_path / "input.json", {"INPUT0": x}),
        concurrency=CALLERS,
        window_requests=2 * CALLERS,
        max_windows=3,
        stability_percent=1000,  # the run is a correctness check: any three windows will do
        timeout_s=180,
    )
    before = _served(app["where"]["http_url"])
    began = time.monotonic()
    result = pa.run(spec, binary)
    took = time.monotonic() - began
    served = _served(app["where"]["http_url"]) - before

    assert not pa.error_lines(result.output), result.output
    assert result.throughput > 0 and result.requests >= 3 * 2 * CALLERS, result
    assert 0 < result.p50_us <= result.p99_us, result
    # Every request perf_analyzer counted reached Triton through the front door (more ran before
    # its measurement began); nothing took the fallback through Serve's handles instead.
    assert served >= result.requests, (served, result.requests)
    assert took < 180
    busy = app["handle"].whereami.remote().result()["busy"]
    assert busy.get("identity", 0) == 0, busy


def test_after_shutdown_nothing_is_left_in_dev_shm(app) -> None:
    """Last in this module: it shuts the app down."""
    from ray import serve

    from ray_triton_shm.node import shutdown_node_actors

    where = app["where"]
    serve.shutdown()
    shutdown_node_actors()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and psutil.pid_exists(where["triton_pid"]):
        time.sleep(0.5)
    assert not psutil.pid_exists(where["triton_pid"]), "the node's Triton outlived the app"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in app["replicas"]):
        time.sleep(0.5)
    assert not [p for p in app["replicas"] if psutil.pid_exists(p)], "a replica outlived serve.shutdown()"
    owners = {where["actor_pid"], where["triton_pid"], *app["replicas"]}
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)]
    assert not left, left
