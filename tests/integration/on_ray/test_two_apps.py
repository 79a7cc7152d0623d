"""``serve run`` and ``serve deploy`` of deployments/two_apps.yaml: two apps, two route prefixes, one file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import yaml

from .conftest import REPO, free_port, frontdoor_on_free_ports, teardown_ray

pytestmark = pytest.mark.slow

TWO_APPS = REPO / "deployments" / "two_apps.yaml"
SERVE = str(Path(sys.executable).with_name("serve"))
PREFIXES = ("/a", "/b")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray with its dashboard (``serve deploy`` talks to it); a copy of the file on a free port."""
    import ray

    spec = frontdoor_on_free_ports(yaml.safe_load(TWO_APPS.read_text()))
    port = free_port()
    spec["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("two_apps") / "two_apps.yaml"
    path.write_text(yaml.safe_dump(spec))
    dashboard_port = free_port()
    context = ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        log_to_driver=False,
    )
    try:
        yield {
            "config": str(path),
            "base": f"http://127.0.0.1:{port}",
            "gcs": context.address_info["gcs_address"],
            "dashboard": f"http://127.0.0.1:{dashboard_port}",
        }
    finally:
        teardown_ray()


def serve_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SERVE, *args], capture_output=True, text=True, timeout=timeout, check=False)


def wait_ready(base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(PREFIXES)
    while pending:
        try:
            if requests.get(f"{base}{pending[0]}/v2/health/ready", timeout=10).status_code == 200:
                pending.pop(0)
                continue
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"apps {pending} not ready within {timeout_s} s"
        time.sleep(1.0)


def check_both_apps(base: str) -> None:
    """Each prefix serves KServe v2 (tritonclient.http, binary tensors) and answers correctly."""
    for scale, prefix in enumerate(PREFIXES, start=1):
        client = httpclient.InferenceServerClient(f"{base.removeprefix('http://')}{prefix}")
        try:
            assert client.is_server_ready() and client.is_model_ready("add_sub")
            assert client.get_model_metadata("add_sub")["inputs"][0]["shape"] == [-1, 16]
            a = np.arange(32, dtype=np.int32).reshape(2, 16) * scale
            b = np.full((2, 16), 7, dtype=np.int32)
            inputs = [
                httpclient.InferInput("INPUT0", [2, 16], "INT32"),
                httpclient.InferInput("INPUT1", [2, 16], "INT32"),
            ]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        finally:
            client.close()


def apps_gone(base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = []
        for prefix in PREFIXES:
            try:
                codes.append(requests.get(f"{base}{prefix}/v2/health/ready", timeout=10).status_code)
            except requests.RequestException:
                codes.append(None)
        if all(code != 200 for code in codes):
            return
        assert time.monotonic() < deadline, f"apps still answer after shutdown: {codes}"
        time.sleep(1.0)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_run_two_apps_then_ctrl_c(cluster) -> None:
    process = subprocess.Popen(
        [SERVE, "run", "--address", cluster["gcs"], cluster["config"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # As from a terminal: SIGINT at its default, so Python turns it into KeyboardInterrupt.
        # A command started in the background by a shell without job control (make test run
        # with `&` from a script) inherits SIGINT ignored, and serve run would never see Ctrl-C.
        preexec_fn=_sigint_default,
    )
    try:
        wait_ready(cluster["base"])
        check_both_apps(cluster["base"])
    finally:
        os.kill(process.pid, signal.SIGINT)  # what Ctrl-C sends: serve run deletes its apps and exits
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode is not None
    assert "triton-a" in output and "triton-b" in output, output[-3000:]
    try:
        apps_gone(cluster["base"])
    except AssertionError as e:  # what serve run said after Ctrl-C is the clue
        said = output[-3000:]
        raise AssertionError(f"{e}\nserve run exited {process.returncode}; its output ends:\n{said}") from e


def test_serve_deploy_two_apps(cluster) -> None:
    deployed = serve_cli("deploy", "--address", cluster["dashboard"], cluster["config"])
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    try:
        wait_ready(cluster["base"])
        check_both_apps(cluster["base"])
        status = serve_cli("status", "--address", cluster["dashboard"])
        assert status.returncode == 0, status.stderr
        apps = yaml.safe_load(status.stdout)["applications"]
        assert {name: app["status"] for name, app in apps.items()} == {
            "triton-a": "RUNNING",
            "triton-b": "RUNNING",
        }
    finally:
        shut = serve_cli("shutdown", "--address", cluster["dashboard"], "--yes")
    assert shut.returncode == 0, shut.stdout + shut.stderr
    apps_gone(cluster["base"])


def _deploy_and_settle(cluster, spec: dict, path: Path, apps: set[str]) -> tuple[dict[str, str], str]:
    """``serve deploy`` of ``spec``, then wait until none of ``apps`` is deploying; (states, status)."""
    path.write_text(yaml.safe_dump(spec))
    deployed = serve_cli("deploy", "--address", cluster["dashboard"], str(path))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deadline = time.monotonic() + 240
    while True:
        status = serve_cli("status", "--address", cluster["dashboard"])
        assert status.returncode == 0, status.stderr
        found = yaml.safe_load(status.stdout).get("applications") or {}
        states = {name: app["status"] for name, app in found.items()}
        if all(states.get(app) in ("RUNNING", "DEPLOY_FAILED") for app in apps):
            return states, status.stdout
        assert time.monotonic() < deadline, status.stdout
        time.sleep(2.0)


def test_a_second_app_on_the_first_ones_front_door_port_fails_and_the_first_keeps_it(
    cluster, tmp_path
) -> None:
    import tritonclient.grpc as grpcclient

    spec = yaml.safe_load(Path(cluster["config"]).read_text())
    first, second = spec["applications"]
    try:
        states, _ = _deploy_and_settle(
            cluster, {**spec, "applications": [first]}, tmp_path / "a.yaml", {"triton-a"}
        )
        assert states == {"triton-a": "RUNNING"}
        # Then app b, given app a's gRPC port: its replica must not start.
        second["args"]["frontdoor"].update(
            http_port=free_port(), grpc_port=first["args"]["frontdoor"]["grpc_port"]
        )
        states, text = _deploy_and_settle(cluster, spec, tmp_path / "both.yaml", {"triton-a", "triton-b"})
        assert states == {"triton-a": "RUNNING", "triton-b": "DEPLOY_FAILED"}, text
        assert "is already the front door of another application" in text
        # Every connection to the port reaches app a: a's front door refuses (NOT_FOUND) a request
        # for another app, so one that landed on a replica of b would fail here.
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for _ in range(8):  # a new connection each
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{first['args']['frontdoor']['grpc_port']}")
            try:
                inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a)
                result = client.infer("add_sub", inputs, headers={"application": "triton-a"})
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
            finally:
                client.close()
    finally:
        shut = serve_cli("shutdown", "--address", cluster["dashboard"], "--yes")
    assert shut.returncode == 0, shut.stdout + shut.stderr
    apps_gone(cluster["base"])
