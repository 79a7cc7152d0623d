"""Faults on a real Ray and real Triton: dead clients, a killed Triton, a killed node actor."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ray_triton_shm import PoolConfig, RayTritonShmError, ServerConfig, TritonCallError, UnavailableError
from tests.helpers import pid_alive

from .conftest import local_ray

pytestmark = pytest.mark.slow


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's actors by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


REPO_MODELS = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "deployments" / "models")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from ray_triton_shm.node import NodeConfig, ensure_node_actors, get_node_actor

    config = NodeConfig(
        # Only the models called here: a Triton with every model takes seconds more to start and stop.
        server=ServerConfig(model_repository=REPO_MODELS, load_models=("add_sub", "sleep")),
        quarantine_s=1.0,
        health_interval_s=0.2,
        idle_shutdown_s=None,
        pools={"add_sub": PoolConfig(slots=4), "sleep": PoolConfig(slots=2)},
    )
    with local_ray():
        ensure_node_actors(config)
        yield config, get_node_actor()


def _add_sub(client, value: int) -> None:
    a = np.full((2, 16), value, np.int32)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.2)


def test_killed_client_process_gives_its_slots_back(node):
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self):
            self.client = NodeClient(config)
            self.leases = []

        def hold(self, n):
            _add_sub(self.client, 1)
            self.leases = [self.client.client.lease("add_sub") for _ in range(n)]
            return True

    holder = Holder.remote()
    assert ray.get(holder.hold.remote(3))
    assert ray.get(actor.stats.remote())["pools"]["add_sub"]["in_use"] == 3
    ray.kill(holder)
    # Another client keeps working on the free slot while the dead one's slots are
    # quarantined (a request of theirs might still run), then gets them all.
    with NodeClient(config) as other:
        _add_sub(other, 2)
        _wait_for(lambda: ray.get(actor.stats.remote())["pools"]["add_sub"]["quarantined"] == 3)
        _wait_for(lambda: ray.get(actor.stats.remote())["pools"]["add_sub"]["free"] == 4)
        leases = [other.client.lease("add_sub", timeout=5) for _ in range(4)]
        for lease in leases:
            lease.release()
        _add_sub(other, 3)
    _wait_for(lambda: ray.get(actor.stats.remote())["pools"]["add_sub"]["free"] == 4)


def test_triton_killed_under_load_is_restarted(node):
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    before = ray.get(actor.info.remote())
    failures: list[Exception] = []
    with NodeClient(config, slots_per_model=1, request_timeout_s=20) as client:
        _add_sub(client, 1)
        killed = False
        deadline = time.monotonic() + 60
        successes_after = 0
        while successes_after < 5:
            assert time.monotonic() < deadline, f"no recovery; failures: {failures[-3:]}"
            if not killed:
                ray.get(actor.kill_triton.remote())
                killed = True
            try:
                _add_sub(client, 7)
                if killed and client.info.epoch > before.epoch:
                    successes_after += 1
            except (UnavailableError, TritonCallError) as e:
                failures.append(e)
                time.sleep(0.2)
    after = ray.get(actor.info.remote())
    assert after.epoch == before.epoch + 1 and after.triton_pid != before.triton_pid
    assert after.restarts == before.restarts + 1
    assert failures, "killing Triton should have failed at least the request in flight"
    assert all(isinstance(e, RayTritonShmError) for e in failures)


def test_killed_node_actor_comes_back_and_clients_reconnect(node):
    import ray

    from ray_triton_shm.node import NodeClient, get_node_actor

    config, actor = node
    before = ray.get(actor.info.remote())
    with NodeClient(config, slots_per_model=1, request_timeout_s=20) as client:
        _add_sub(client, 1)
        ray.kill(actor, no_restart=False)
        _wait_for(lambda: not pid_alive(before.triton_pid))  # Triton dies with its actor
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "client never reconnected"
            try:
                _add_sub(client, 5)
                break
            except RayTritonShmError:
                time.sleep(0.5)
        assert client.info.instance_id != before.instance_id
    restarted = get_node_actor()
    info = ray.get(restarted.info.remote())
    assert info.instance_id != before.instance_id
    # The old segments were swept by the new incarnation.
    from ray_triton_shm._private.shm.sweep import stale_segments

    assert not [s for s in stale_segments() if "_node_" in s]


def test_requests_racing_a_triton_restart_are_unavailable_never_not_found(node):
    """A request that reaches the restarted Triton before the node actor registered its regions
    there again is told to try again (UNAVAILABLE: the ingress answers 503), not NOT_FOUND
    "Unable to find shared memory region" (a 404 to a KServe caller that sent no shm at all)."""
    import threading

    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    errors: list[Exception] = []
    with NodeClient(config, request_timeout_s=20) as client:
        _add_sub(client, 1)
        for _ in range(3):
            before = ray.get(actor.info.remote()).epoch
            stop = threading.Event()

            def hammer(client=client, stop=stop):
                while not stop.is_set():
                    try:
                        _add_sub(client, 3)
                    except RayTritonShmError as e:
                        errors.append(e)
                        time.sleep(0.05)

            threads = [threading.Thread(target=hammer) for _ in range(4)]
            for t in threads:
                t.start()
            try:
                time.sleep(0.5)
                ray.get(actor.kill_triton.remote())
                try:
                    _wait_for(lambda before=before: ray.get(actor.info.remote()).epoch > before, timeout=120)
                except AssertionError:
                    health = ray.get(actor.status.remote(), timeout=30)["health"]
                    raise AssertionError(f"Triton not restarted in 120 s: {health}") from None
                time.sleep(1.0)  # requests on the new Triton
            finally:
                stop.set()
                for t in threads:
                    t.join()
            _add_sub(client, 4)
    assert errors, "killing Triton under load should have failed some requests"
    not_found = [e for e in errors if isinstance(e, TritonCallError) and e.status == "NOT_FOUND"]
    assert not not_found, f"{len(not_found)} of {len(errors)} failures were NOT_FOUND: {not_found[0]}"
    assert all(isinstance(e, UnavailableError) for e in errors), {type(e).__name__ for e in errors}
