"""The front door inside Serve, under 8 external callers: a rolling update, a hung replica, autoscaling.

A local Ray, the node's real Triton, the shipped configs (deployments/triton_shm.yaml
and triton_shm_autoscaling.yaml) on free ports, and the scenarios of
:mod:`ray_triton_shm._private.bench.citizen` (which also runs them through
Serve's proxies for comparison): unmodified tritonclient callers (4 HTTP, 4
gRPC) outside Ray, every output checked, a new connection after a failed call.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from ray_triton_shm._private.bench import citizen
from tests.helpers import wait_for

from .conftest import config_copy, deploy_config, http_identity, replica_log, teardown_ray

_OWNERS: set[int] = set()  # every process whose /dev/shm segments must be gone at the end


@pytest.fixture(scope="module")
def ray_up():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        teardown_ray()
    owners = _OWNERS | set(citizen._PIDS.values())
    assert wait_for(
        lambda: not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)],
        30,
        0.5,
    ), "segments left in /dev/shm"


@pytest.fixture
def app_deleted():
    """Deletes the scenario's app afterwards, noting its node's processes for the /dev/shm check."""
    yield
    import ray
    from ray import serve

    from ray_triton_shm import RayTritonShmError
    from ray_triton_shm.node import get_node_actor

    try:
        info = ray.get(get_node_actor().info.remote())
        _OWNERS.update({info.actor_pid, info.triton_pid})
    except RayTritonShmError:  # the node runs an earlier test's config too: the test noted its own
        pass
    serve.delete("triton")


def test_a_rolling_update_under_load_drops_no_call(ray_up, app_deleted, tmp_path) -> None:
    result = citizen.rolling_update(tmp_path, "frontdoor")
    print("rolling update:", result)
    assert result["replicas_before"] == 2 and result["replaced"] and result["replaced_by_one"]
    assert result["ok"] > 100
    assert (result["failed"], result["wrong"]) == (0, 0), result["failures"]
    # The node actor held the ports through the redeploys; deleting the app closes them.
    import ray
    from ray import serve

    from ray_triton_shm.node import get_node_actor

    node = get_node_actor()
    held = ray.get(node.status.remote())["held_doors"]
    assert sorted(h["port"] for h in held) == sorted(result["door_ports"])
    serve.delete("triton")
    assert wait_for(lambda: not any(_listening(port) for port in result["door_ports"]), 10)
    assert ray.get(node.status.remote())["held_doors"] == []


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


def test_a_hung_replica_takes_no_new_connection_and_is_replaced(ray_up, app_deleted, tmp_path) -> None:
    result = citizen.hung_replica(tmp_path, "frontdoor", stopped_s=30.0)
    print("hung replica:", result)
    assert result["replacement_started"] and result["replacement_started_s"] <= 15.0
    assert result["wrong"] == 0 and result["failed_before_stop"] == 0
    # At most the calls on the connections it held when it stopped: one per caller.
    assert result["failed"] <= 8, result["failures"]


def test_autoscaling_follows_front_door_load(ray_up, app_deleted, tmp_path) -> None:
    result = citizen.autoscaling(tmp_path, "frontdoor", load_s=40.0)
    print("autoscaling (s, replicas):", result["timeline"])
    assert result["timeline"][0][1] == 1
    assert result["peak"] >= 2, "front-door load did not scale the app up"
    assert result["back_to_1"], "the app did not scale back down after the load"
    assert result["wrong"] == 0 and result["ok"] > 0


def test_the_door_takes_what_serve_changes_in_place(ray_up, tmp_path) -> None:
    """``serve deploy`` with only ``max_ongoing_requests`` and the access log changed: Serve
    reconfigures the replica it has, and its front door takes the new bound and access-log setting."""
    import numpy as np
    import yaml
    from ray import serve

    path, _ = config_copy(tmp_path, quarantine_s=1.0)
    spec = yaml.safe_load(path.read_text())
    application = spec["applications"][0]
    deployment = {"name": "TritonDeployment", "num_replicas": 1, "health_check_period_s": 1}
    application["deployments"] = [{**deployment, "logging_config": {"enable_access_log": False}}]
    door = f"127.0.0.1:{application['args']['frontdoor']['http_port']}"
    line = "POST /v2/models/identity/infer 200 "

    def call() -> None:
        x = np.ones((1, 16), dtype=np.float32)
        assert np.array_equal(http_identity(door, x), x)

    deploy_config(spec)
    try:
        handle = serve.get_app_handle("triton")
        where = handle.whereami.remote().result()
        _OWNERS.update({where["actor_pid"], where["triton_pid"], where["pid"]})
        assert handle.frontdoor_stats.remote().result()["max_ongoing"] == 32  # the deployment's default
        logged = replica_log("triton").count(line)  # the app's earlier replicas' lines too
        call()
        time.sleep(2.0)
        assert replica_log("triton").count(line) == logged  # access log off
        application["deployments"] = [
            {**deployment, "max_ongoing_requests": 5, "logging_config": {"enable_access_log": True}}
        ]
        deploy_config(spec)
        assert wait_for(lambda: handle.frontdoor_stats.remote().result()["max_ongoing"] == 5, 30, 0.5)
        assert handle.whereami.remote().result()["pid"] == where["pid"]  # reconfigured, not replaced
        call()
        assert wait_for(lambda: replica_log("triton").count(line) == logged + 1, 10, 0.5)
    finally:
        serve.delete("triton")


@pytest.mark.parametrize("with_door", [True, False], ids=["front door", "no front door"])
def test_a_restarted_node_actor_keeps_its_idle_replicas_and_doors(
    ray_up, app_deleted, tmp_path, with_door: bool
) -> None:
    """The node actor killed: Ray restarts it, knowing no user and holding nothing. The idle
    replica's next reports attach it again (else the actor would retire after
    ``idle_shutdown_s``) and name its door's fixed ports, which the new actor holds again."""
    import signal

    import numpy as np
    import ray
    import yaml
    from ray import serve
    from tritonclient.utils import InferenceServerException

    from ray_triton_shm import RayTritonShmError

    path, _ = config_copy(tmp_path, quarantine_s=1.0)
    spec = yaml.safe_load(path.read_text())
    application = spec["applications"][0]
    application["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1, "health_check_period_s": 1}]
    application["args"]["idle_shutdown_s"] = 15.0
    door = application["args"]["frontdoor"]
    ports = sorted([door["http_port"], door["grpc_port"]])
    if not with_door:
        del application["args"]["frontdoor"]
        ports = []

    deploy_config(spec)
    handle = serve.get_app_handle("triton")
    where = handle.whereami.remote().result()
    _OWNERS.update({where["actor_pid"], where["triton_pid"], where["pid"]})
    node = _node_actor(where["actor_pid"])  # its handle stays valid across the restart

    def held() -> list[int]:
        return sorted(h["port"] for h in _held(node))

    assert held() == ports
    os.kill(where["actor_pid"], signal.SIGKILL)

    def restarted() -> bool:
        try:
            return ray.get(node.info.remote(), timeout=30).actor_pid != where["actor_pid"]
        except ray.exceptions.RayError:  # the actor still restarting
            return False

    assert wait_for(restarted, 60, 0.5)
    info = ray.get(node.info.remote())
    _OWNERS.update({info.actor_pid, info.triton_pid})
    assert wait_for(lambda: held() == ports, 30, 0.5), held()

    def users() -> list[int]:
        return [u["pid"] for u in ray.get(node.status.remote(), timeout=30)["users"]]

    assert wait_for(lambda: users() == [where["pid"]], 30, 0.5), users()
    time.sleep(17.0)  # past idle_shutdown_s: still there, with its user
    assert ray.get(node.info.remote()).actor_pid == info.actor_pid
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    def answers() -> bool:
        try:
            if not with_door:
                return np.array_equal(handle.infer.remote("identity", {"INPUT0": x}).result()["OUTPUT0"], x)
            return np.array_equal(http_identity(f"127.0.0.1:{door['http_port']}", x), x)
        except (InferenceServerException, RayTritonShmError, ray.exceptions.RayError):  # met the restart
            return False

    assert wait_for(answers, 60, 1.0)


def test_a_replica_whose_listener_stops_is_replaced_and_its_port_answers_again(
    ray_up, app_deleted, tmp_path
) -> None:
    """The app's HTTP listening socket destroyed from outside (``ss -K``): the replica's
    listener stops, its health checks fail, Serve replaces it, the new replica binds a new
    socket, and the node actor lets the dead one go and holds the new one."""
    import numpy as np
    import yaml
    from ray import serve
    from tritonclient.utils import InferenceServerException

    path, _ = config_copy(tmp_path, quarantine_s=1.0)
    spec = yaml.safe_load(path.read_text())
    application = spec["applications"][0]
    application["deployments"] = [{"name": "TritonDeployment", "num_replicas": 1, "health_check_period_s": 1}]
    door = application["args"]["frontdoor"]
    url = f"127.0.0.1:{door['http_port']}"
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    deploy_config(spec)
    handle = serve.get_app_handle("triton")
    where = handle.whereami.remote().result()
    _OWNERS.update({where["actor_pid"], where["triton_pid"], where["pid"]})
    node = _node_actor(where["actor_pid"])
    assert np.array_equal(http_identity(url, x), x)
    assert wait_for(lambda: len(_held(node)) == 2, 30, 0.5)

    start = time.monotonic()
    destroy = ["ss", "-K", "-t", "state", "listening", "sport", "=", f":{door['http_port']}"]
    subprocess.run(destroy, check=True, capture_output=True)
    with pytest.raises(ConnectionRefusedError):  # nothing listens on the port now
        socket.create_connection(("127.0.0.1", door["http_port"]), timeout=5).close()

    def replica_pid() -> int | None:
        try:
            return handle.whereami.remote().result(timeout_s=10)["pid"]
        except Exception:  # the replica being replaced
            return None

    assert wait_for(lambda: replica_pid() not in (None, where["pid"]), 90, 0.5), "not replaced"
    replaced_s = time.monotonic() - start
    _OWNERS.add(replica_pid())

    def answers() -> bool:
        try:
            return np.array_equal(http_identity(url, x), x)
        except (InferenceServerException, OSError):
            return False

    assert wait_for(answers, 30, 0.5)
    assert "listener stops accepting" in replica_log("triton")
    assert wait_for(lambda: [h["listening"] for h in _held(node)] == [True, True], 30, 0.5), _held(node)
    print(f"listener destroyed: replica replaced after {replaced_s:.1f} s")


def test_a_stopping_replica_cuts_a_call_that_outlasts_its_drain_within_serves_grace(ray_up, tmp_path) -> None:
    """``graceful_shutdown_timeout_s`` 8 s, ``drain_timeout_s`` 10 s: the drain takes the 3 s that
    Serve's grace leaves (8 s less Serve's 2 s wait loop, 2 s for the app's status and 1 s for
    the close; the replica says so when it starts), then cuts a 30 s call and closes its
    connection, before Serve would kill the replica."""
    import http.client
    import json
    import threading

    import yaml
    from ray import serve

    path, _ = config_copy(tmp_path, quarantine_s=1.0)
    spec = yaml.safe_load(path.read_text())
    application = spec["applications"][0]
    application["deployments"] = [
        {"name": "TritonDeployment", "num_replicas": 1, "graceful_shutdown_timeout_s": 8}
    ]
    door = application["args"]["frontdoor"]
    door["drain_timeout_s"] = 10.0
    deploy_config(spec)
    handle = serve.get_app_handle("triton")
    where = handle.whereami.remote().result()
    _OWNERS.update({where["actor_pid"], where["triton_pid"], where["pid"]})
    assert "leaves its drain 3 s, not frontdoor.drain_timeout_s (10 s)" in replica_log("triton")
    ended: list[float] = []
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [30.0]}]})

    def slow_call() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", door["http_port"], timeout=60)
        try:
            conn.request("POST", "/v2/models/sleep/infer", body=body)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            ended.append(time.monotonic())
            conn.close()

    caller = threading.Thread(target=slow_call)
    caller.start()
    assert wait_for(lambda: handle.frontdoor_stats.remote().result()["ongoing"] == 1, 30, 0.2)
    start = time.monotonic()
    serve.delete("triton")
    caller.join(60)
    assert ended, "the call did not end"
    print(f"a stopping replica cut its call {ended[0] - start:.1f} s after serve.delete")
    assert ended[0] - start < 8.0, "the call outlived Serve's grace"
    assert wait_for(lambda: "calls still running after 3 s were cut" in replica_log("triton"), 10, 0.5)
    assert wait_for(lambda: not os.path.exists(f"/proc/{where['pid']}"), 30, 0.5)


def _node_actor(actor_pid: int):
    """The handle of the node actor with process ``actor_pid`` (an earlier test's node actor, of
    another config, may still be there)."""
    import ray

    from ray_triton_shm._private.node.node_lifecycle import node_actor_names
    from ray_triton_shm.node import NAMESPACE

    return next(
        actor
        for actor in (ray.get_actor(n, namespace=NAMESPACE) for n in node_actor_names())
        if ray.get(actor.info.remote()).actor_pid == actor_pid
    )


def _held(node) -> list[dict]:
    """The front-door ports ``node`` holds open, by port."""
    import ray

    return sorted(ray.get(node.status.remote(), timeout=30)["held_doors"], key=lambda h: h["port"])
