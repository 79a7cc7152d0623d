"""Health beyond death on a real Ray and real Triton: a hung (SIGSTOPped) Triton is killed and restarted."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ray_triton_shm import PoolConfig, ServerConfig, TritonCallError, UnavailableError
from tests.helpers import stop_process

from .conftest import local_ray

pytestmark = pytest.mark.slow

REPO_MODELS = str(__import__("pathlib").Path(__file__).resolve().parents[3] / "deployments" / "models")
UNHEALTHY_S = 3.0
BACKOFF_S = 6.0
REQUEST_TIMEOUT_S = 2.0
PROMPT_S = 2.0  # info and status must answer within this during a hang
PROBE_TIMEOUT_S = 1.0  # node_actor._probe_timeout for UNHEALTHY_S: a probe started before the stop may fail


@pytest.fixture(scope="module")
def node():
    from ray_triton_shm.node import NodeConfig, ensure_node_actors, get_node_actor

    config = NodeConfig(
        # Only the model called here: the tests restart this Triton several times.
        server=ServerConfig(model_repository=REPO_MODELS, load_models=("add_sub",)),
        quarantine_s=1.0,
        health_interval_s=0.2,
        unhealthy_after_s=UNHEALTHY_S,
        restart_backoff_s=BACKOFF_S,
        restart_backoff_max_s=60.0,
        idle_shutdown_s=None,  # the module holds the actor's handle across tests
        pools={"add_sub": PoolConfig(slots=4)},
    )
    with local_ray():
        ensure_node_actors(config)
        yield config, get_node_actor()


def _add_sub(client, value: int) -> None:
    a = np.full((2, 16), value, np.int32)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
    np.testing.assert_array_equal(out["OUTPUT1"], 0 * a)


def _start_time(pid: int) -> int | None:
    """The process's start time (field 22 of /proc/<pid>/stat); None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _timed(ref, limit: float = 30.0):
    import ray

    started = time.monotonic()
    value = ray.get(ref, timeout=limit)
    return value, time.monotonic() - started


def _stop(pid: int) -> int | None:
    start = _start_time(pid)
    assert start is not None, f"Triton {pid} is not running"
    stop_process(pid)
    return start


def _cont_if_still_ours(pid: int, start: int | None) -> None:
    """Undo our SIGSTOP if the test failed before the node killed the process."""
    if start is not None and _start_time(pid) == start:
        os.kill(pid, signal.SIGCONT)


def test_hung_triton_is_killed_restarted_and_clients_recover(node):
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    before = ray.get(actor.info.remote())
    health_before = ray.get(actor.status.remote())["health"]
    assert health_before["state"] == "ok"
    with NodeClient(config, slots_per_model=2, request_timeout_s=REQUEST_TIMEOUT_S) as client:
        _add_sub(client, 1)
        pid = before.triton_pid
        start = _stop(pid)
        stopped_at = time.monotonic()
        try:
            # A call during the hang ends with a typed error by its deadline, never a hang.
            called = time.monotonic()
            with pytest.raises((UnavailableError, TritonCallError)):
                _add_sub(client, 2)
            call_s = time.monotonic() - called
            assert call_s < REQUEST_TIMEOUT_S + PROMPT_S, f"call took {call_s:.1f}s"

            gone_at = answered_at = None
            states, slowest = set(), 0.0
            deadline = stopped_at + UNHEALTHY_S + 120
            while answered_at is None:
                assert time.monotonic() < deadline, f"no recovery; health states seen: {states}"
                info, info_s = _timed(actor.info.remote())
                status, status_s = _timed(actor.status.remote())
                slowest = max(slowest, info_s, status_s)
                states.add(status["health"]["state"])
                if gone_at is None and _start_time(pid) != start:
                    gone_at = time.monotonic() - stopped_at
                if info.epoch > before.epoch:
                    try:
                        _add_sub(client, 3)
                        answered_at = time.monotonic() - stopped_at
                    except (UnavailableError, TritonCallError):
                        pass
                time.sleep(0.1)
        finally:
            _cont_if_still_ours(pid, start)
        print(
            f"\nhung Triton: killed after {gone_at:.2f}s, first correct answer {answered_at:.2f}s "
            f"after SIGSTOP (unhealthy_after_s={UNHEALTHY_S:g}); slowest info/status {slowest:.2f}s; "
            f"states {sorted(states)}"
        )
        assert gone_at is not None, "the hung Triton was never killed"
        assert UNHEALTHY_S - PROBE_TIMEOUT_S - 0.2 <= gone_at <= UNHEALTHY_S + 5.0, gone_at
        assert slowest < PROMPT_S, f"info/status took {slowest:.2f}s during the hang"
        assert "unready" in states or "restarting" in states, states
        for value in range(5):  # keeps answering, correctly
            _add_sub(client, 10 + value)
        assert client.info.epoch > before.epoch  # it reconnected to the new Triton

    after = ray.get(actor.info.remote())
    assert after.triton_pid != pid and after.epoch == before.epoch + 1
    assert after.restarts == before.restarts + 1
    health = ray.get(actor.status.remote())["health"]
    assert health["state"] == "ok", health
    assert health["restarts"] == health_before["restarts"] + 1
    assert health["consecutive_failures"] >= 1 and health["last_restart_s"] > 0
    # The region of the pool was registered again on the new Triton: a new client works too.
    with NodeClient(config, slots_per_model=1, request_timeout_s=30) as fresh:
        _add_sub(fresh, 4)


def test_repeated_hangs_back_off_and_grants_fail_fast_meanwhile(node):
    import ray

    from ray_triton_shm.node import NodeClient

    config, actor = node
    first = ray.get(actor.info.remote())
    restarts0 = ray.get(actor.status.remote())["health"]["restarts"]
    seen_backoff: dict | None = None
    acquire_s: float | None = None
    hangs = 0
    while seen_backoff is None:
        assert hangs < 3, "no backoff after three hangs in a row"
        info = ray.get(actor.info.remote())
        pid = info.triton_pid
        start = _stop(pid)
        hangs += 1
        try:
            deadline = time.monotonic() + UNHEALTHY_S + 4 * BACKOFF_S + 120
            while True:
                assert time.monotonic() < deadline, "no restart"
                now_info, info_s = _timed(actor.info.remote())
                status, status_s = _timed(actor.status.remote())
                assert max(info_s, status_s) < PROMPT_S, (info_s, status_s)
                health = status["health"]
                if health["state"] == "backoff" and seen_backoff is None:
                    seen_backoff = health
                    # Grants do not wait on a restart: a typed error at once.
                    started = time.monotonic()
                    with pytest.raises(UnavailableError):
                        ray.get(actor.acquire.remote("add_sub"), timeout=30)
                    acquire_s = time.monotonic() - started
                if now_info.epoch > info.epoch:
                    break
                time.sleep(0.1)
        finally:
            _cont_if_still_ours(pid, start)
        assert _start_time(pid) != start, "the hung Triton is still there"

    assert seen_backoff["consecutive_failures"] >= 1, seen_backoff
    assert (
        0 < seen_backoff["next_attempt_in_s"] <= BACKOFF_S * 2 ** (seen_backoff["consecutive_failures"] - 1)
    )
    assert acquire_s is not None and acquire_s < PROMPT_S, acquire_s
    health = ray.get(actor.status.remote())["health"]
    assert health["restarts"] == restarts0 + hangs, health
    assert health["consecutive_failures"] >= 2, health
    assert ray.get(actor.info.remote()).epoch == first.epoch + hangs
    print(f"\nbackoff seen after {hangs} hang(s): {seen_backoff}; acquire during backoff {acquire_s:.2f}s")
    with NodeClient(config, slots_per_model=1, request_timeout_s=30) as client:
        for value in range(3):
            _add_sub(client, value)
