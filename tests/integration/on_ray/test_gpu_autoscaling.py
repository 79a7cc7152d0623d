"""Placement that starts GPU nodes: Ray's fake multi-node autoscaler, the shipped GPU config.

A head without GPUs and a worker type with a GPU (``min_workers: 0``), as in
``cluster.yaml``. Deploying ``deployments/triton_shm_gpu.yaml`` makes the
autoscaler start a worker; the replicas land there, that node gets its own
node actor and Triton, and deleting the app leaves nothing behind (node actor,
Triton, segments, the worker itself).

The fake provider runs every "node" as raylets on this machine, so the cluster
gets its own GCS port and Ray temp dir, and is stopped by killing exactly the
processes that carry that temp dir (never ``ray stop``: other Ray runs share
this machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers import free_port, pid_alive

from .conftest import frontdoor_on_free_ports

# alone: it starts its cluster with `ray start`, which a `ray.init()` beside it would join.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[3]
GPU_CONFIG = REPO / "deployments" / "triton_shm_gpu.yaml"
WORKER_TYPE = "gpu_worker"


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.5)


def _pids_with(markers: tuple[str, ...], gcs_address: str) -> list[int]:
    """Processes of this cluster: an argument names one of ``markers`` (its temp dir, its
    session) or ends with its GCS address (workers, raylets and agents all carry one)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(m in a for a in args for m in markers) or any(a.endswith(gcs_address) for a in args):
            pids.append(int(entry))
    return pids


def _autoscaling_config(head_cpus: int, gcs_address: str) -> dict:
    """The whole fake_multinode cluster config (the wheel ships no example.yaml)."""
    return {
        "cluster_name": "rtshm-fake-gpu",
        "max_workers": 1,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,  # 6 s idle, then the worker goes
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            # As cluster.yaml's gpu_worker: a GPU, none running until something asks for one.
            WORKER_TYPE: {
                "resources": {"CPU": 2, "GPU": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@pytest.fixture(scope="module")
def fake_cluster():
    """A fake autoscaling cluster of our own: CPU head, GPU workers from 0."""
    import ray

    from ray_triton_shm.node import shutdown_node_actors

    # Short: Ray puts unix sockets under it.
    temp_dir = tempfile.mkdtemp(prefix="rtfake", dir="/tmp")
    port = free_port()
    ip = ray.util.get_node_ip_address()
    config_path = Path(temp_dir) / "autoscaling.json"
    config_path.write_text(json.dumps(_autoscaling_config(2, f"{ip}:{port}")))
    # No token auth: `ray start` would turn it on for a new cluster with the user's ~/.ray
    # token, which this test's driver and the fake nodes need not share.
    env = dict(
        os.environ,
        RAY_FAKE_CLUSTER="1",
        AUTOSCALER_UPDATE_INTERVAL_S="1",
        RAY_TMPDIR=temp_dir,
        RAY_AUTH_MODE="disabled",
    )
    ray_cli = str(Path(sys.executable).parent / "ray")
    if not os.path.exists(ray_cli):
        ray_cli = shutil.which("ray") or "ray"
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    markers: tuple[str, ...] = (temp_dir,)
    os.environ.update(RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="disabled")
    try:
        subprocess.run(
            [
                ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                f"--temp-dir={temp_dir}", f"--autoscaling-config={config_path}",
                "--include-dashboard=false", "--disable-usage-stats",
            ],
            env=env, check=True, capture_output=True, timeout=180,
        )  # fmt: skip
        ray.init(address=f"{ip}:{port}", log_to_driver=False)
        markers = (temp_dir, ray._private.worker._global_node.session_name)
        yield temp_dir
    finally:
        try:
            if ray.is_initialized():
                from ray import serve

                try:
                    serve.shutdown()
                finally:
                    shutdown_node_actors()
                    ray.shutdown()
        finally:
            _stop_cluster(temp_dir, markers, f"{ip}:{port}")
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _stop_cluster(temp_dir: str, markers: tuple[str, ...], gcs_address: str) -> None:
    """Stop every process of this cluster (and only those), then remove its temp dir."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = _pids_with(markers, gcs_address)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.2)
    left = [p for p in _pids_with(markers, gcs_address) if pid_alive(p)]
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"processes of the fake cluster outlived it: {left}"


def _alive_nodes() -> dict[str, dict]:
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def test_deploying_the_gpu_config_starts_a_gpu_worker_and_deleting_it_leaves_nothing(fake_cluster):
    import ray
    from ray import serve

    from ray_triton_shm._private.node.node_lifecycle import node_actor_names
    from ray_triton_shm.serve import run_config_file

    head = ray.get_runtime_context().get_node_id()
    assert set(_alive_nodes()) == {head}, "no worker before the app asks for a GPU"
    assert not node_actor_names(), "no node actor before the app is deployed"

    # The shipped GPU config as it is, on this test's port, with quick idle shutdown; proxies on
    # the head only (fake nodes share this machine's ports).
    spec = frontdoor_on_free_ports(yaml.safe_load(GPU_CONFIG.read_text()))
    spec["proxy_location"] = "HeadOnly"
    spec["http_options"]["port"] = free_port()
    spec["grpc_options"]["port"] = free_port()
    spec["applications"][0]["args"]["idle_shutdown_s"] = 3
    spec["applications"][0]["args"]["quarantine_s"] = 1
    options = spec["applications"][0]["deployments"][0]["ray_actor_options"]
    assert options["num_gpus"] > 0, "the shipped config must place replicas on GPU nodes"
    path = Path(fake_cluster) / "triton_shm_gpu.yaml"
    path.write_text(yaml.safe_dump(spec))

    handle = run_config_file(str(path))["triton"]  # returns once the replicas run: the worker is up

    workers = {nid: n for nid, n in _alive_nodes().items() if nid != head}
    assert len(workers) == 1, f"the autoscaler should have started one GPU worker: {workers}"
    (worker,) = workers
    assert workers[worker]["Resources"].get("GPU") == 1

    seen = {}
    for i in range(20):
        x = np.full((1, 64), i, np.float32)
        outputs, origin = handle.infer_with_origin.remote("whoami", {"INPUT0": x}).result()
        np.testing.assert_array_equal(outputs["OUTPUT0"], x)
        assert origin["path"] == "shm"
        assert origin["node_id"] == worker, "replicas must run on the GPU worker, never on the head"
        assert origin["triton_node_id"] == worker, "served by the Triton of the worker's own node actor"
        assert set(outputs["SERVER_PID"].ravel()) == {origin["triton_pid"]}
        seen[origin["pid"]] = origin
    assert len(seen) == 2, "both replicas answered"
    origin = next(iter(seen.values()))
    triton_pid, actor_pid = origin["triton_pid"], origin["actor_pid"]
    assert len({o["triton_pid"] for o in seen.values()}) == 1, "one Triton per node, shared by its replicas"
    assert node_actor_names(worker) and not node_actor_names(head), "a node actor on the worker only"
    assert pid_alive(triton_pid) and pid_alive(actor_pid)

    serve.delete("triton")

    # The replicas are gone; idle_shutdown_s later the node actor stops Triton and exits.
    _wait_for(lambda: not node_actor_names(worker), 90, "the worker's node actor to go")
    _wait_for(lambda: not pid_alive(triton_pid), 30, "the worker's Triton to stop")
    _wait_for(lambda: not pid_alive(actor_pid), 30, "the node actor process to exit")
    owners = [actor_pid, triton_pid, *seen]
    _wait_for(
        lambda: not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)],
        30,
        "the node's shared-memory segments to be unlinked",
    )
    # Idle, the worker is terminated by the autoscaler (idle_timeout_minutes 0.1).
    _wait_for(lambda: worker not in _alive_nodes(), 120, "the idle GPU worker to be removed")
    assert not node_actor_names()
