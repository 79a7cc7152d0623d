"""Case 8 on a real Ray and real Triton: a SIGKILLed Serve replica holding leases, a Ray Data
worker dying mid-batch; plus the short soak through Serve (handle and HTTP)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.slow

REPO_MODELS = str(Path(__file__).resolve().parents[3] / "deployments" / "models")
SLOTS = 4
PER_REPLICA = 2


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's classes by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in time")
        time.sleep(0.25)


def _pool_stats(model: str, config) -> dict[str, int]:
    import ray

    from ray_triton_shm.node import get_node_actor

    return ray.get(get_node_actor(config).stats.remote())["pools"][model]


def test_short_soak_through_serve_every_response_matches(ray_local):
    """The short form of `make soak`: 16 callers, half by handle and half by HTTP, on 4 slots."""
    from ray_triton_shm._private.cli.soak import soak_serve

    reports = soak_serve(duration_s=15, callers=16, slots_per_replica=PER_REPLICA, replicas=2)
    for report in reports:
        print(report.summary())
        assert report.requests > 0
        assert report.error_count == 0, report.errors
        assert report.mismatches == 0


def test_sigkilled_replica_holding_leases_is_replaced_and_its_slots_reclaimed(ray_local):
    import ray
    from ray import serve

    from ray_triton_shm.serve import build_app, build_node_config

    args = {
        "model_repository": REPO_MODELS,
        "slots_per_model": PER_REPLICA,
        "quarantine_s": 1.0,
        # A dead replica's slots come back after its requests' deadline plus the quarantine.
        "request_timeout_s": 15.0,
        "server": {"load_models": ["sleep"]},  # only the model called here: a quicker Triton start
        "pools": {"sleep": {"slots": SLOTS}},
    }
    config = build_node_config(**{k: v for k, v in args.items() if k != "slots_per_model"})
    # Not on Serve's default port 8000: other Ray runs may share the machine.
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    handle = serve.run(build_app(args, {"num_replicas": 1}), name="victim", route_prefix="/victim")
    try:
        victim = handle.whereami.remote().result()["pid"]
        one = {"INPUT0": np.full((1, 1), 0.01, np.float32)}
        handle.infer.remote("sleep", one).result()
        # Nobody keeps idle slots: the answer's views pin its slot only until Ray has sent them,
        # which can end a moment after the caller has its result.
        _wait_for(lambda: _pool_stats("sleep", config)["in_use"] == 0, 10, "the answered request's slot back")
        # Both of its slots are leased by requests that sleep on the server when it dies.
        slow = {"INPUT0": np.full((1, 1), 3.0, np.float32)}
        in_flight = [handle.infer.remote("sleep", slow) for _ in range(PER_REPLICA)]
        # Kill it only once both requests hold their slot (the replica says so), not after a guess.
        _wait_for(
            lambda: handle.whereami.remote().result(timeout_s=10)["busy"].get("sleep") == PER_REPLICA,
            30,
            "both slots leased",
        )
        os.kill(victim, signal.SIGKILL)
        outcomes = []
        for response in in_flight:
            try:
                outcomes.append(response.result(timeout_s=90))
            except Exception as e:  # the replica died under it: a clear error, not a hang
                outcomes.append(e)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                # Ray's own word for a replica that died, not a timeout or a wrong answer.
                assert isinstance(outcome, ray.exceptions.RayActorError), repr(outcome)
            else:
                np.testing.assert_allclose(outcome["OUTPUT0"], [[3.0]])
        assert any(isinstance(o, Exception) for o in outcomes), "the kill hit no request in flight"
        # Serve replaces the replica; requests work again.
        _wait_for(lambda: handle.whereami.remote().result(timeout_s=10)["pid"] != victim, 90, "new replica")
        out = handle.infer.remote("sleep", one).result(timeout_s=60)
        np.testing.assert_allclose(out["OUTPUT0"], [[0.01]])
        # The dead replica's slots were quarantined, then came back.
        _wait_for(lambda: _pool_stats("sleep", config)["free"] == SLOTS, 30, "slots of the dead replica back")
    finally:
        serve.delete("victim")
    _wait_for(
        lambda: _pool_stats("sleep", config)["free"] == SLOTS, 30, "all slots back after the app is gone"
    )


class _DiesOnce:
    """A TritonPredictor whose worker process dies (os._exit) the first time it sees row 777."""

    def __init__(self, marker: str, config) -> None:
        from ray_triton_shm.data import TritonPredictor

        self._marker = marker
        self._predict = TritonPredictor(model="add_sub", node_config=config, slots_per_model=1)

    def __call__(self, batch):
        if (batch["INPUT0"][:, 0] == 777).any():
            try:
                fd = os.open(self._marker, os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(1)  # mid-batch, without any cleanup
        return self._predict(batch)


def test_ray_data_worker_dying_mid_batch_every_row_once_and_correct(ray_local, tmp_path: Path):
    import ray

    from ray_triton_shm import ServerConfig
    from ray_triton_shm.node import NodeConfig, ensure_node_actors

    # Only the model called here: a quicker Triton start and stop.
    server = ServerConfig(model_repository=REPO_MODELS, load_models=("add_sub",))
    config = NodeConfig(server=server, quarantine_s=1.0)
    ensure_node_actors(config)
    marker = str(tmp_path / "died")
    rows = 2_000
    ids = np.arange(rows, dtype=np.int32)
    ds = ray.data.from_numpy(np.stack([ids] * 16, axis=1)).map_batches(
        lambda b: {"INPUT0": b["data"], "INPUT1": np.full_like(b["data"], 5)}, batch_format="numpy"
    )
    out = ds.map_batches(
        _DiesOnce,
        fn_constructor_kwargs={"marker": marker, "config": config},
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
        batch_size=200,
        batch_format="numpy",
        max_restarts=-1,
        max_task_retries=-1,
    ).take_all()
    assert os.path.exists(marker), "the worker never died: the test proved nothing"
    assert len(out) == rows
    seen = [int(row["INPUT0"][0]) for row in out]
    assert sorted(seen) == list(range(rows)), "a row was lost or repeated"
    for row in out:
        np.testing.assert_array_equal(row["OUTPUT0"], row["INPUT0"] + 5)
        np.testing.assert_array_equal(row["OUTPUT1"], row["INPUT0"] - 5)
    # The dead worker's slot comes back after the quarantine.
    _wait_for(lambda: _pool_stats("add_sub", config)["free"] == 4, 60, "slots of finished workers back")
