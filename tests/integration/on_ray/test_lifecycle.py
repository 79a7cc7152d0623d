"""Node Tritons that follow their users, on a real Ray and a real Triton.

Slots shared on demand by many processes; a timed-out slot never reused
early by another process; the node actor gone (Triton and segments too) once
its last user is, or when it is killed; a config per Triton (redeploy, two
apps, delete).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import PoolConfig, TritonCallError, UnavailableError
from tests.helpers import free_port, pid_alive

pytestmark = pytest.mark.slow

REPO_MODELS = Path(__file__).resolve().parents[3] / "deployments" / "models"


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's actors by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _wait_for(predicate, timeout: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{pid}_")]


def _config(**kwargs):
    from ray_triton_shm import ServerConfig
    from ray_triton_shm.node import NodeConfig

    kwargs.setdefault("health_interval_s", 0.2)
    # Only the models these tests call: each node actor here starts a Triton of its own, and every
    # Python-backend model is a stub process to start (and stop) on a 2-core machine.
    server = ServerConfig(model_repository=str(REPO_MODELS), load_models=("add_sub", "sleep"))
    return NodeConfig(server=server, **kwargs)


def _gone(info) -> bool:
    """The node actor of ``info``, its Triton and all its segments are gone."""
    pids = (info.actor_pid, info.triton_pid)
    return not any(pid_alive(p) for p in pids) and not _segments_of(info.actor_pid)


def _client_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Caller:
        """A process of its own with a NodeClient."""

        def __init__(self, config, **kwargs):
            from ray_triton_shm.node import NodeClient

            self.client = NodeClient(config, **kwargs)

        def sleep(self, seconds: float, *, hold: float = 0.0):
            """Sleep model with value ``seconds``; optionally keep a zero-copy view for ``hold`` s."""
            x = np.full((1, 1), seconds, np.float32)
            try:
                out = self.client.infer("sleep", {"INPUT0": x}, copy=False)
            except (TritonCallError, UnavailableError) as e:
                return {"error": type(e).__name__}
            view = out["OUTPUT0"]
            first = float(view[0, 0])
            time.sleep(hold)
            return {"first": first, "after": float(view[0, 0]), "pid": os.getpid()}

        def close(self):
            self.client.close()

    return Caller


def test_six_processes_share_a_two_slot_pool(ray_local):
    import ray

    from ray_triton_shm.node import NodeClient, get_node_actor

    config = _config(pools={"sleep": PoolConfig(slots=2, lease_timeout_s=120.0)}, idle_shutdown_s=None)
    Caller = _client_actor()
    callers = [Caller.remote(config) for _ in range(6)]
    started = time.monotonic()
    # Each process makes three calls of 0.3 s: 18 calls on 2 slots take >= 2.7 s.
    results = ray.get([c.sleep.remote(0.3) for c in callers for _ in range(3)], timeout=120)
    took = time.monotonic() - started
    assert all("error" not in r for r in results), results
    assert all(r["first"] == pytest.approx(0.3) for r in results)
    assert len({r["pid"] for r in results}) == 6
    actor = get_node_actor(config)
    stats = ray.get(actor.stats.remote())
    assert stats["pools"]["sleep"]["slots"] == 2
    assert len(stats["users"]) == 6
    ray.get([c.close.remote() for c in callers])
    for c in callers:
        ray.kill(c)
    _wait_for(lambda: ray.get(actor.stats.remote())["pools"]["sleep"]["free"] == 2, 30, "both slots free")
    print(f"six processes, 18 calls of 0.3 s on 2 slots: {took:.1f} s")
    # Two processes that each hold a lease do not keep a third one waiting for idle slots.
    with NodeClient(config) as mine:
        assert mine.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})["OUTPUT0"][0, 0] == 0.0
    ray.get(actor.shutdown.remote())
    ray.kill(actor, no_restart=True)


def test_a_timed_out_slot_is_not_handed_to_another_process(ray_local):
    """A times out on a 3 s request and closes; B must not get the slot while Triton may still write it."""
    import ray

    from ray_triton_shm.node import get_node_actor

    config = _config(pools={"sleep": PoolConfig(slots=1, lease_timeout_s=60.0)}, quarantine_s=6.0)
    Caller = _client_actor()
    a = Caller.remote(config, request_timeout_s=1.0)
    b = Caller.remote(config)
    assert "error" in ray.get(a.sleep.remote(3.0))  # timed out after 1 s; Triton runs it 2 s more
    ray.get(a.close.remote())
    actor = get_node_actor(config)
    assert ray.get(actor.stats.remote())["pools"]["sleep"]["quarantined"] == 1
    # B holds a zero-copy view of its answer until well after A's request ended on the server.
    answer = ray.get(b.sleep.remote(0.25, hold=4.0), timeout=120)
    assert answer == {"first": 0.25, "after": 0.25, "pid": answer["pid"]}
    ray.get(b.close.remote())
    for c in (a, b):
        ray.kill(c)
    info = ray.get(actor.info.remote())
    ray.get(actor.shutdown.remote())
    ray.kill(actor, no_restart=True)
    _wait_for(lambda: _gone(info), 30, "actor, Triton and segments gone")


def test_node_actor_goes_when_its_last_user_does(ray_local):
    import ray

    from ray_triton_shm._private.node.node_lifecycle import node_actor_names
    from ray_triton_shm.node import NodeClient, get_node_actor

    config = _config(idle_shutdown_s=2.0)
    Caller = _client_actor()
    other = Caller.remote(config)
    with NodeClient(config) as client:
        info = client.info
        a = np.ones((1, 16), np.int32)
        assert client.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == [[2] * 16]
        users = ray.get(get_node_actor(config).stats.remote())["users"]
        assert len(users) == 2
    time.sleep(4.0)  # past the grace period: the other process still uses it
    assert pid_alive(info.triton_pid) and _segments_of(info.actor_pid)
    ray.kill(other)  # dies without a close
    took = _wait_for(lambda: _gone(info), 60, "actor, Triton and segments gone after the last user died")
    assert not [n for n in node_actor_names() if config.fingerprint() in n]
    print(f"gone {took:.1f} s after the last user died (idle_shutdown_s=2)")
    # The next user starts a new one.
    with NodeClient(config) as client:
        assert client.info.instance_id != info.instance_id
        assert client.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == [[2] * 16]
        new = client.info
    _wait_for(lambda: _gone(new), 60, "the new one gone too")


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_a_killed_node_actor_leaves_no_triton_and_no_segments(ray_local, how):
    import ray

    from ray_triton_shm.node import NodeClient, get_node_actor

    config = _config(idle_shutdown_s=None, pools={"add_sub": PoolConfig(slots=2)})
    with NodeClient(config) as client:
        a = np.ones((1, 16), np.int32)
        client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        info = client.info
    assert _segments_of(info.actor_pid)
    actor = get_node_actor(config)
    # The directory Triton's Python backend made, which a killed Triton leaves: the reaper's to remove
    # (None when another test's Triton started beside this one: then it could not be told apart).
    python_env = ray.get(actor.status.remote(), timeout=60)["reaper"]["python_env"]
    assert python_env is None or os.path.isdir(python_env), python_env
    if python_env is None:
        print("the Python backend's directory was not known: not checked")
    if how == "sigkill":
        os.kill(info.actor_pid, signal.SIGKILL)
    else:
        ray.kill(actor, no_restart=True)
    # ray.kill goes through the GCS and the raylet: seconds when idle, more on a loaded machine.
    took = _wait_for(
        lambda: _gone(info) and not (python_env and os.path.exists(python_env)),
        90,
        "Triton, segments and the Python backend's directory gone with the actor",
    )
    print(f"{how}: Triton and segments gone {took:.1f} s after the actor was killed")
    if how == "sigkill":  # Ray restarts it: a fresh Triton, which shutdown takes down
        new = None

        def back() -> bool:
            nonlocal new
            try:
                new = ray.get(actor.info.remote(), timeout=30)
            except ray.exceptions.ActorUnavailableError:
                return False
            return True

        _wait_for(back, 120, "the restarted actor answers")
        assert new.actor_pid != info.actor_pid and pid_alive(new.triton_pid)
        ray.get(actor.shutdown.remote())
        ray.kill(actor, no_restart=True)
        _wait_for(lambda: _gone(new), 30, "restarted actor gone")


def _repository(tmp: Path, *models: str) -> str:
    for model in models:
        shutil.copytree(REPO_MODELS / model, tmp / model)
    return str(tmp)


def test_redeploy_two_apps_and_delete(ray_local, tmp_path):
    """Each config gets its Triton; a redeploy serves the new one; delete leaves nothing."""
    import ray
    from ray import serve

    from ray_triton_shm._private.node.node_lifecycle import node_actor_names
    from ray_triton_shm.serve import app

    first = _repository(tmp_path / "first", "add_sub")
    second = _repository(tmp_path / "second", "identity", "sleep")
    args = {
        "idle_shutdown_s": 2.0,
        "health_interval_s": 0.2,
        "pools": {"identity": {"slots": 2, "max_shapes": {"INPUT0": [64], "OUTPUT0": [64]}}},
    }
    a = np.ones((1, 16), np.int32)
    x = np.ones((1, 8), np.float32)
    try:
        # Not on Serve's default port 8000: other Ray runs may share the machine.
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        one = serve.run(app({"model_repository": first, **args}), name="one", route_prefix="/one")
        two = serve.run(app({"model_repository": second, **args}), name="two", route_prefix="/two")
        assert one.infer.remote("add_sub", {"INPUT0": a, "INPUT1": a}).result()["OUTPUT0"].tolist() == [
            [2] * 16
        ]
        assert two.infer.remote("identity", {"INPUT0": x}).result()["OUTPUT0"].tolist() == x.tolist()
        with pytest.raises(TritonCallError):  # app one's Triton has no identity model
            one.infer.remote("identity", {"INPUT0": x}).result()
        where_one = one.whereami.remote().result()
        where_two = two.whereami.remote().result()
        assert where_one["triton_pid"] != where_two["triton_pid"]
        assert len(node_actor_names()) == 2

        # Redeploy app one with the second repository: it serves the new models.
        one = serve.run(app({"model_repository": second, **args}), name="one", route_prefix="/one")
        assert one.infer.remote("identity", {"INPUT0": x}).result()["OUTPUT0"].tolist() == x.tolist()
        with pytest.raises(TritonCallError):
            one.infer.remote("add_sub", {"INPUT0": a, "INPUT1": a}).result()
        # Same config as app two now: the same Triton.
        assert one.whereami.remote().result()["triton_pid"] == where_two["triton_pid"]
        old = where_one["triton_pid"]
        took = _wait_for(lambda: not pid_alive(old), 60, "the old Triton stopped after the redeploy")
        print(f"redeploy: old Triton gone {took:.1f} s after the new app answered")
        # The actor stops its Triton first, then itself: its name goes a moment later.
        _wait_for(lambda: len(node_actor_names()) == 1, 30, "only the new config's node actor left")

        serve.delete("one")
        serve.delete("two")
        started = time.monotonic()
        _wait_for(lambda: not node_actor_names(), 60, "no node actor after both apps were deleted")
        _wait_for(lambda: not pid_alive(where_two["triton_pid"]), 30, "Triton gone")
        took = time.monotonic() - started
        assert not _segments_of(where_one["actor_pid"]) and not _segments_of(where_two["actor_pid"])
        print(f"delete: node actor and Triton gone {took:.1f} s after serve.delete")
    finally:
        serve.shutdown()
    assert ray.is_initialized()
