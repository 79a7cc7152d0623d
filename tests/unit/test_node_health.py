"""The node health monitor's state machine and backoff, with a fake clock and fake probes."""

from __future__ import annotations

import pytest

from ray_triton_shm._private.node.node_health import HealthMonitor
from ray_triton_shm.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(**kwargs) -> tuple[HealthMonitor, Clock]:
    clock = Clock()
    kwargs.setdefault("unhealthy_after_s", 3.0)
    kwargs.setdefault("backoff_s", 2.0)
    kwargs.setdefault("backoff_max_s", 10.0)
    return HealthMonitor(clock=clock, **kwargs), clock


def restart(monitor: HealthMonitor, clock: Clock, ok: bool = True, takes: float = 1.0) -> None:
    monitor.restart_started()
    assert monitor.state == "restarting"
    clock.advance(takes)
    monitor.restart_finished(ok, "" if ok else "start failed")


def test_ready_server_stays_ok():
    monitor, clock = make()
    for _ in range(100):
        assert monitor.observe(ready=True, alive=True) is False
        clock.advance(0.5)
    snap = monitor.snapshot()
    assert snap["state"] == "ok"
    assert snap["consecutive_failures"] == 0 and snap["restarts"] == 0
    assert snap["last_restart_s"] is None and snap["next_attempt_in_s"] == 0.0


def test_unready_live_server_is_restarted_only_after_unhealthy_after_s():
    monitor, clock = make()
    monitor.observe(ready=True, alive=True)
    clock.advance(0.5)
    decisions = []
    for _ in range(6):  # failing probes at 0 .. 2.5 s into the run
        decisions.append(monitor.observe(ready=False, alive=True))
        assert monitor.state == "unready"
        clock.advance(0.5)
    assert decisions == [False] * 6
    snap = monitor.snapshot()
    assert snap["unready_for_s"] == pytest.approx(3.0)
    assert snap["next_attempt_in_s"] == pytest.approx(0.0)
    assert monitor.observe(ready=False, alive=True) is True  # 3 s since the first failed probe


def test_unready_time_counts_from_the_start_of_the_first_failed_probe():
    monitor, clock = make()
    started = clock.now
    clock.advance(1.0)  # the probe timed out after 1 s
    assert monitor.observe(ready=False, alive=True, started_at=started) is False
    assert monitor.snapshot()["unready_for_s"] == pytest.approx(1.0)
    clock.advance(2.0)
    assert monitor.observe(ready=False, alive=True, started_at=clock.now) is True


def test_a_stalled_health_thread_is_not_a_failing_server():
    monitor, clock = make()
    monitor.observe(ready=True, alive=True)
    clock.advance(60.0)  # no probe for a minute (no CPU): one failure is not 3 s of failing
    assert monitor.observe(ready=False, alive=True) is False
    assert monitor.snapshot()["state"] == "unready"


def test_a_ready_answer_resets_the_unready_clock():
    monitor, clock = make()
    monitor.observe(ready=False, alive=True)
    clock.advance(2.5)
    assert monitor.observe(ready=True, alive=True) is False
    assert monitor.snapshot()["unready_for_s"] == 0.0
    clock.advance(0.5)
    assert monitor.observe(ready=False, alive=True) is False
    clock.advance(2.5)
    assert monitor.observe(ready=False, alive=True) is False
    assert monitor.snapshot()["next_attempt_in_s"] == pytest.approx(0.5)


def test_dead_server_is_restarted_at_once():
    monitor, clock = make()
    monitor.observe(ready=True, alive=True)
    clock.advance(0.1)
    assert monitor.observe(ready=False, alive=False) is True


def test_no_second_decision_while_restarting():
    monitor, clock = make()
    assert monitor.observe(ready=False, alive=False) is True
    monitor.restart_started()
    clock.advance(20)
    assert monitor.observe(ready=False, alive=False) is False
    assert monitor.snapshot()["state"] == "restarting"


def test_successful_restart_counts_and_is_ready_again():
    monitor, clock = make()
    assert monitor.observe(ready=False, alive=False)
    restart(monitor, clock, ok=True, takes=1.5)
    snap = monitor.snapshot()
    assert snap["state"] == "ok"
    assert snap["restarts"] == 1 and snap["consecutive_failures"] == 1
    assert snap["last_restart_s"] == pytest.approx(1.5)
    # The new server gets the full unhealthy_after_s before it counts as hung.
    clock.advance(2.9)
    assert monitor.observe(ready=False, alive=True) is False


def test_repeated_failures_back_off_exponentially_up_to_the_cap():
    monitor, clock = make(backoff_s=2.0, backoff_max_s=10.0, stable_after_s=1000.0)
    waits = []
    for _ in range(6):
        start = clock.now
        while not monitor.observe(ready=False, alive=False):
            assert monitor.state == "backoff"
            assert monitor.snapshot()["next_attempt_in_s"] > 0
            clock.advance(0.25)
        waits.append(clock.now - start)
        restart(monitor, clock, ok=True, takes=0.0)
    assert waits == [0.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert monitor.snapshot()["consecutive_failures"] == 6


def test_failed_restart_is_a_failure_and_backs_off():
    monitor, clock = make(backoff_s=2.0)
    assert monitor.observe(ready=False, alive=False)
    restart(monitor, clock, ok=False)
    snap = monitor.snapshot()
    assert snap["state"] == "backoff" and snap["restarts"] == 0
    assert snap["consecutive_failures"] == 1 and snap["last_error"] == "start failed"
    assert snap["next_attempt_in_s"] == pytest.approx(2.0)
    assert monitor.observe(ready=False, alive=False) is False
    clock.advance(2.0)
    assert monitor.observe(ready=False, alive=False) is True


def test_hung_again_soon_after_a_restart_waits_for_backoff():
    monitor, clock = make(unhealthy_after_s=1.0, backoff_s=5.0, backoff_max_s=20.0)
    assert monitor.observe(ready=False, alive=False)
    restart(monitor, clock)
    assert monitor.observe(ready=False, alive=True) is False  # hung again at once
    clock.advance(1.0)
    assert monitor.observe(ready=False, alive=True) is False  # unhealthy, but 5 s backoff
    snap = monitor.snapshot()
    assert snap["state"] == "backoff" and snap["next_attempt_in_s"] == pytest.approx(4.0)
    clock.advance(4.0)
    assert monitor.observe(ready=False, alive=True) is True


def test_streak_ends_after_staying_ready_for_stable_after_s():
    monitor, clock = make(backoff_s=2.0, stable_after_s=30.0)
    for _ in range(3):
        while not monitor.observe(ready=False, alive=False):
            clock.advance(0.5)
        restart(monitor, clock)
    assert monitor.snapshot()["consecutive_failures"] == 3
    for _ in range(59):
        clock.advance(0.5)
        monitor.observe(ready=True, alive=True)
    assert monitor.snapshot()["consecutive_failures"] == 3  # 29.5 s: not yet
    clock.advance(0.5)
    monitor.observe(ready=True, alive=True)
    assert monitor.snapshot()["consecutive_failures"] == 0
    # A new streak starts without waiting.
    assert monitor.observe(ready=False, alive=False) is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"unhealthy_after_s": 0},
        {"unhealthy_after_s": -1},
        {"unhealthy_after_s": float("nan")},
        {"unhealthy_after_s": 1, "backoff_s": -1},
        {"unhealthy_after_s": 1, "backoff_s": 5, "backoff_max_s": 1},
    ],
)
def test_bad_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        HealthMonitor(**kwargs)


def test_status_renders_the_health_line():
    from ray_triton_shm._private.cli import status

    monitor, clock = make(backoff_s=2.0)
    assert monitor.observe(ready=False, alive=False)
    restart(monitor, clock, ok=False, takes=1.5)
    node = {
        "node_id": "ab" * 28,
        "node_ip": "10.0.0.5",
        "info": {
            "version": "2.51.0",
            "grpc_url": "g",
            "http_url": "h",
            "metrics_url": "m",
            "triton_pid": -1,
            "restarts": 1,
        },
        "health": monitor.snapshot(),
        "models": [],
        "pools": {},
        "traffic": [],
    }
    line = next(line for line in status.render([node]).splitlines() if "health" in line)
    assert line.split()[:2] == ["health", "backoff"]
    assert "consecutive failures 1" in line and "next restart in 2.0s" in line
    assert "last restart took 1.5s" in line and "last error: start failed" in line
    node["health"] = make()[0].snapshot()
    line = next(line for line in status.render([node]).splitlines() if "health" in line)
    assert line.strip() == "health ok"


def test_node_config_health_settings_explicit_over_environment_over_default(monkeypatch):
    from ray_triton_shm._private.node.node_config import NodeConfig
    from ray_triton_shm.config import ServerConfig

    server = ServerConfig(model_repository="/models")
    for name in ("UNHEALTHY_AFTER_S", "RESTART_BACKOFF_S", "RESTART_BACKOFF_MAX_S"):
        monkeypatch.delenv(f"RAY_TRITON_SHM_{name}", raising=False)
    default = NodeConfig(server=server)
    assert 0 < default.unhealthy_after_s <= 30
    assert 0 < default.restart_backoff_s <= default.restart_backoff_max_s
    monkeypatch.setenv("RAY_TRITON_SHM_UNHEALTHY_AFTER_S", "7.5")
    monkeypatch.setenv("RAY_TRITON_SHM_RESTART_BACKOFF_S", "2")
    monkeypatch.setenv("RAY_TRITON_SHM_RESTART_BACKOFF_MAX_S", "9")
    from_env = NodeConfig(server=server)
    assert (from_env.unhealthy_after_s, from_env.restart_backoff_s, from_env.restart_backoff_max_s) == (
        7.5,
        2,
        9,
    )
    explicit = NodeConfig(server=server, unhealthy_after_s=3.0, restart_backoff_s=0.5)
    assert (explicit.unhealthy_after_s, explicit.restart_backoff_s) == (3.0, 0.5)
    monkeypatch.setenv("RAY_TRITON_SHM_UNHEALTHY_AFTER_S", "soon")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_UNHEALTHY_AFTER_S"):
        NodeConfig(server=server)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"unhealthy_after_s": 0},
        {"unhealthy_after_s": -2.0},
        {"unhealthy_after_s": float("inf")},
        {"unhealthy_after_s": float("nan")},
        {"unhealthy_after_s": True},
        {"unhealthy_after_s": "5"},
        {"restart_backoff_s": -1.0},
        {"restart_backoff_s": 10.0, "restart_backoff_max_s": 5.0},
        {"restart_backoff_max_s": float("inf")},
    ],
)
def test_node_config_refuses_bad_health_settings(monkeypatch, kwargs):
    from ray_triton_shm._private.node.node_config import NodeConfig
    from ray_triton_shm.config import ServerConfig

    for name in ("UNHEALTHY_AFTER_S", "RESTART_BACKOFF_S", "RESTART_BACKOFF_MAX_S"):
        monkeypatch.delenv(f"RAY_TRITON_SHM_{name}", raising=False)
    with pytest.raises(ConfigError):
        NodeConfig(server=ServerConfig(model_repository="/models"), **kwargs)
