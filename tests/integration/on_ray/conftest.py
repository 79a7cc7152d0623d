"""Ray fixtures: a real local Ray with node actors and the Serve app from deployments/."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[3]
CONFIG_FILE = REPO / "deployments" / "triton_shm.yaml"


def frontdoor_on_free_ports(spec: dict) -> dict:
    """``spec`` (a Serve config) with every app's front door moved to free ports; returns ``spec``."""
    for application in spec["applications"]:
        door = (application.get("args") or {}).get("frontdoor")
        if door:
            door.update({k: free_port() for k in ("http_port", "grpc_port") if door.get(k) is not None})
    return spec


def config_copy(tmp_dir: Path, **app_args) -> tuple[Path, int]:
    """deployments/triton_shm.yaml with a free HTTP port (and front-door ports) and extra app args."""
    spec = frontdoor_on_free_ports(yaml.safe_load(CONFIG_FILE.read_text()))
    port = free_port()
    spec["http_options"]["port"] = port
    if "grpc_options" in spec:  # not Serve's fixed 9000: other Ray runs may share the machine
        spec["grpc_options"]["port"] = free_port()
    spec["applications"][0]["args"].update(app_args)
    path = tmp_dir / "triton_shm.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, port


def replica_log(app: str, deployment: str = "TritonDeployment") -> str:
    """The text of ``app``'s replica log file(s), where Serve writes a replica's lines (access log too)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return "".join(path.read_text() for path in sorted(logs.glob(f"replica_{app}_{deployment}_*.log")))


def workers_stderr() -> str:
    """The text of every Ray worker's stderr file (what Ray sends to the driver's console)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return "".join(path.read_text(errors="replace") for path in sorted(logs.glob("worker-*.err")))


def start_serve_on_a_free_port() -> None:
    """``serve.start`` with its HTTP proxy on a port from the OS, not Serve's default 8000: other
    test processes and Ray runs share the machine."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})


def _stop_node_actors_together() -> None:
    """Ask every node actor to stop its Triton at once: each stop takes seconds, and
    shutdown_node_actors (which then finds them stopped and removes them) goes one by one."""
    import ray

    from ray_triton_shm._private.node.node_config import NAMESPACE
    from ray_triton_shm._private.node.node_lifecycle import node_actor_names

    refs = []
    for name in node_actor_names():
        try:
            refs.append(ray.get_actor(name, namespace=NAMESPACE).shutdown.remote())
        except ValueError:  # already gone
            continue
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=60)


def teardown_ray() -> None:
    import ray
    from ray import serve

    from ray_triton_shm.node import shutdown_node_actors

    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            try:
                _stop_node_actors_together()
            finally:
                shutdown_node_actors()
                ray.shutdown()


def init_ray(metrics_port: int | None = None):
    """``ray.init`` of a private local Ray (2 CPUs, no dashboard); with ``metrics_port``, Ray's
    Prometheus endpoint there, reported every second. Returns what ``ray.init`` returns."""
    import ray

    metrics = {}
    if metrics_port is not None:
        metrics = {
            "_metrics_export_port": metrics_port,
            "_system_config": {"metrics_report_interval_ms": 1000},
        }
    return ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **metrics)


def deploy_config(spec: dict, timeout_s: float = 180) -> None:
    """Deploy the Serve config ``spec`` as ``serve deploy`` does (the config's code version: a
    redeploy that changes only options reconfigures the replicas Serve has), and wait until every
    app in it runs.

    Raises:
        AssertionError: An app failed to deploy, or does not run within ``timeout_s``.
    """
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(spec)
    client = serve_api.serve_start(
        http_options=config.http_options.model_dump(), proxy_location=config.proxy_location
    )
    client.deploy_apps(config)
    names = [application["name"] for application in spec["applications"]]
    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else "MISSING" for name in names}
        failed = {n: apps[n].message for n, s in states.items() if s == "DEPLOY_FAILED"}
        if failed:
            raise AssertionError(f"deploy failed: {failed}")
        if all(s == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"apps not running within {timeout_s} s: {states}")
        time.sleep(1)


def http_identity(url: str, x: np.ndarray, binary: bool = True, model: str = "identity") -> np.ndarray:
    """``model``'s ``OUTPUT0`` for ``x``, from an unmodified ``tritonclient.http`` client at ``url``.

    The client is closed before this returns: an unclosed one is closed by the garbage
    collector, on whichever thread runs it, and on one of Ray's threads gevent crashes the
    process.
    """
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, network_timeout=120)
    try:
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
        return client.infer(model, [tensor], outputs=wanted).as_numpy("OUTPUT0")
    finally:
        client.close()


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A private local Ray (2 CPUs, no dashboard) for the block; Serve and node actors torn down after."""
    init_ray()
    try:
        yield
    finally:
        teardown_ray()


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    """Local Ray, the Serve app started from the config file (quick slot reclaim for tests)."""
    from ray_triton_shm.serve import run_config_file

    path, port = config_copy(tmp_path_factory.mktemp("serve"), quarantine_s=1.0)
    with local_ray():
        handles = run_config_file(str(path))
        yield handles["triton"], f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def ray_local():
    """A private local Ray for one module, torn down (Serve and node actors too) after it."""
    with local_ray():
        yield
