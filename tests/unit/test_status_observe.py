"""status rendering, the CLI's status arguments, and the observer interface (no Ray, no server)."""

from __future__ import annotations

import logging

import pytest

from ray_triton_shm._private.cli import cli, status
from ray_triton_shm._private.triton import observe

NODE = {
    "node_id": "9ca5c04698e0d210f5c732d47cd73766aea816c533747f55eb15f353",
    "node_ip": "10.0.0.5",
    "info": {
        "version": "2.51.0",
        "grpc_url": "127.0.0.1:41415",
        "http_url": "127.0.0.1:36745",
        "metrics_url": "http://127.0.0.1:52005/metrics",
        "triton_pid": 6365,
        "restarts": 2,
    },
    "models": [
        {"name": "add_sub", "version": "1", "state": "READY"},
        {"name": "broken", "version": "1", "state": "UNAVAILABLE"},
    ],
    "pools": {"add_sub": {"slots": 8, "free": 5, "in_use": 2, "quarantined": 1, "slot_bytes": 512}},
    "users": [{"user": "u1", "pid": 41, "kind": "serve", "for_s": 3.0}],
    "frontdoors": [
        {
            "pid": 41,
            "app": "triton",
            "http_port": 8100,
            "grpc_port": 8101,
            "connections": 9,
            "ongoing": 3,
            "calls": 1200,
            "refused": 2,
        },
    ],
    "held_doors": [
        {"port": 8100, "app": "triton", "replicas_away": False},
        {"port": 8101, "app": "triton", "replicas_away": True},
    ],
    "idle_shutdown_s": 30.0,
    "traffic": [{"model": "add_sub", "path": "shm", "requests": 12, "bytes": 3 << 20}],
}


def test_render_shows_every_part_of_a_node() -> None:
    text = status.render([NODE])
    assert "node 9ca5c04698e0  (10.0.0.5)" in text
    assert "Triton 2.51.0" in text and "grpc 127.0.0.1:41415" in text and "restarts 2" in text
    assert "models ready: add_sub" in text and "broken (UNAVAILABLE)" in text
    pool_line = next(line for line in text.splitlines() if line.strip().startswith("add_sub") and "B" in line)
    assert pool_line.split()[:5] == ["add_sub", "8", "5", "2", "1"]
    assert "users: 1 (serve 1)" in text
    door_line = next(line for line in text.splitlines() if line.strip().startswith("triton"))
    assert door_line.split() == ["triton", "41", "8100", "8101", "9", "3", "1200", "2"]
    assert "ports held open by the node: 8100 (triton), 8101 (triton, no replica on it)" in text
    traffic_line = next(line for line in text.splitlines() if " shm " in line)
    assert traffic_line.split() == ["add_sub", "shm", "12", "3.0", "MB"]
    assert "1 node(s), 3.0 MB moved in all" in text


def test_render_handles_no_actors_and_dead_actors() -> None:
    assert "no Triton node actors" in status.render([])
    text = status.render([{"node_id": "ab" * 28, "node_ip": "", "error": "GetTimeoutError: slow"}])
    assert "not answering: GetTimeoutError: slow" in text


def test_status_arguments() -> None:
    args = cli.build_parser().parse_args(["status"])
    assert (args.address, args.json, args.func) == ("auto", False, cli._status)
    args = cli.build_parser().parse_args(["status", "--address", "10.0.0.5:6379", "--json"])
    assert (args.address, args.json) == ("10.0.0.5:6379", True)
    assert cli.build_parser().parse_args(["demo", "--hold"]).hold


def test_a_failing_observer_never_breaks_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def request(self, *args):
            raise RuntimeError("observer bug")

    with caplog.at_level(logging.DEBUG, logger=observe.__name__):
        observe.safely(Broken().request, "m", "shm", 1, 0.1)  # logged, not raised
    failures = [r for r in caplog.records if r.name == observe.__name__ and "failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert str(failures[0].exc_info[1]) == "observer bug"
    calls: list[tuple[object, ...]] = []
    observe.safely(lambda *args: calls.append(args), "m", "shm", 1, 0.1)  # a working one is called once
    assert calls == [("m", "shm", 1, 0.1)]


def test_render_shouts_server_warnings() -> None:
    from ray_triton_shm._private.triton.server_env import LaunchPlan, cpu_fallback_warning

    warning = cpu_fallback_warning(LaunchPlan("/c/tritonserver", "embedded (/c)"), gpus=8)  # a faked GPU node
    text = status.render([{**NODE, "warnings": [warning]}])
    assert f"  !!! {warning}" in text.splitlines()
    assert "!!!" not in status.render([NODE])


def test_status_reports_a_reaper_that_died() -> None:
    down = {"pid": 4242, "alive": False, "restarts": 1, "last_failure": "reaper (pid 4241) died"}
    text = status.render([{**NODE, "reaper": down}])
    assert "reaper" in text and "4241" in text and "restarts 1" in text, text
    up = {"pid": 4242, "alive": True, "restarts": 0, "last_failure": None}
    assert "reaper pid 4242 ok" in status.render([{**NODE, "reaper": up}])


def test_an_event_batch_adds_up_what_it_queued() -> None:
    batch = observe.EventBatch()
    batch.request("m", "shm", 100, 0.5)
    batch.request("m", "shm", 20, 0.25)
    batch.request("m", "grpc", 7, 1.0)
    batch.request("n", "shm", 0, 2.0)
    batch.lease_wait("m", 0.125)
    batch.lease_wait("m", 0.0)
    batch.error("m", "InputError")
    batch.error("m", "InputError")
    batch.error("n", "PoolTimeoutError")
    assert batch.queued() == 9
    sums = batch.drain()
    assert sums.requests == {("m", "shm"): [2, 120], ("m", "grpc"): [1, 7], ("n", "shm"): [1, 0]}
    assert sums.request_seconds == {("m", "shm"): [0.5, 0.25], ("m", "grpc"): [1.0], ("n", "shm"): [2.0]}
    assert sums.lease_waits == {"m": [0.125, 0.0]}
    assert sums.errors == {("m", "InputError"): 2, ("n", "PoolTimeoutError"): 1}
    assert batch.queued() == 0 and not batch.drain()
    assert batch  # an observer is truthy even with nothing queued (`observer or default` keeps it)


def test_an_event_batch_drained_while_threads_record_counts_every_event_once() -> None:
    import threading

    batch = observe.EventBatch()
    threads, per_thread = 8, 5000
    drained: list[observe.EventSums] = []
    done = threading.Event()

    def record(worker: int) -> None:
        for i in range(per_thread):
            batch.request("m", f"p{worker % 2}", i, 0.001)
            batch.lease_wait("m", 0.0)

    def drain() -> None:
        while not done.is_set():
            drained.append(batch.drain())

    readers = [threading.Thread(target=drain) for _ in range(2)]
    writers = [threading.Thread(target=record, args=(w,)) for w in range(threads)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    drained.append(batch.drain())
    requests = sum(n for s in drained for n, _ in s.requests.values())
    nbytes = sum(b for s in drained for _, b in s.requests.values())
    seconds = sum(len(v) for s in drained for v in s.request_seconds.values())
    waits = sum(len(v) for s in drained for v in s.lease_waits.values())
    assert requests == seconds == waits == threads * per_thread
    assert nbytes == threads * sum(range(per_thread))
