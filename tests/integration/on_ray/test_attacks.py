"""The front door attacked: each class of attack, bounded, while legitimate HTTP and gRPC callers run.

The shipped config (deployments/triton_shm.yaml: two replicas, the front door
on, its settings as shipped; every port moved to a free one), a local Ray and
the node's real Triton. Legitimate tritonclient caller processes call ``identity``
throughout, checking every output: one HTTP, one gRPC, and one gRPC making two calls at
once on its channel. Each attack
(:mod:`ray_triton_shm._private.bench.attacks`, at half the table's counts) is
judged by :func:`~ray_triton_shm._private.bench.attacks.judge.judge`: no legitimate
call failed or got a wrong answer, no gap without a right answer longer than
3 s (or 3x the quiet time's just before), every replica's private memory (RssAnon) grew by less
than 256 MiB, the callers were served again after it, and every slot is free
again. ``python -m ray_triton_shm bench --attacks`` runs the same attacks at full
count against the front door and Triton's own ports side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import psutil
import pytest
import yaml

from ray_triton_shm._private.bench.attacks import BY_NAME
from ray_triton_shm._private.bench.attacks.judge import Bounds, Verdict, judge
from ray_triton_shm._private.bench.attacks.legit import LegitCallers
from ray_triton_shm._private.bench.attacks.table import Servers, servers_of
from tests.helpers import grpc_engine_serving

from .conftest import CONFIG_FILE, free_port, frontdoor_on_free_ports, local_ray

BOUNDS = Bounds(hold_s=4.0, quiet_s=1.5, scale=0.5)
STALL_BOUNDS = dataclasses.replace(BOUNDS, hold_s=5.0)  # well past the 3 s gap floor and the 1 s slot stall
FRONTDOOR: dict = {}
"""Front-door settings over the shipped ones (none: the shipped config is what is attacked)."""


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """(the app's servers, the legitimate callers on its front door, whereami of a replica)."""
    with attacked_app(tmp_path_factory, FRONTDOOR) as where:
        yield where


@contextlib.contextmanager
def attacked_app(tmp_path_factory, frontdoor: dict):
    """The shipped app with ``frontdoor`` over its front-door settings, its callers running: see
    :func:`attacked`."""
    from ray_triton_shm.serve import run_config_file

    spec = frontdoor_on_free_ports(yaml.safe_load(CONFIG_FILE.read_text()))
    spec["http_options"]["port"] = free_port()
    spec["grpc_options"]["port"] = free_port()
    app = spec["applications"][0]
    app["args"]["frontdoor"].update(frontdoor)
    replicas = app["deployments"][0]["num_replicas"]
    assert replicas == 2
    path = tmp_path_factory.mktemp("attacks") / "triton_shm.yaml"
    path.write_text(yaml.safe_dump(spec))
    with local_ray():
        handle = run_config_file(str(path))["triton"]
        servers = servers_of(handle, app["args"]["frontdoor"], replicas)
        where = handle.whereami.remote().result()
        with LegitCallers(servers.frontdoor.http_url, servers.frontdoor.grpc_url) as callers:
            yield servers, callers, where


def _busy_slots() -> dict[str, int]:
    import ray

    from ray_triton_shm.node import get_node_actor

    pools = ray.get(get_node_actor().status.remote(), timeout=60)["pools"]
    return {model: p["slots"] - p["free"] for model, p in pools.items() if p["slots"] != p["free"]}


def _attack(attacked, name: str, bounds: Bounds = BOUNDS) -> Verdict:
    servers, callers, _ = attacked
    assert isinstance(servers, Servers)
    verdict = judge(BY_NAME[name], servers.frontdoor, callers, servers.pids(servers.frontdoor), bounds)
    said = f"{name}: {verdict.reasons} {verdict}"
    assert verdict.failed == 0 and verdict.wrong == 0, said
    assert max(verdict.gaps_s.values()) <= max(
        bounds.gap_floor_s, bounds.gap_factor * verdict.baseline_gap_s
    ), said
    assert verdict.rss_growth_mib < bounds.rss_mib, said
    assert verdict.recovered_s is not None, said
    assert verdict.held, said
    callers.pause()  # their own slots out of the count
    try:
        # A slot whose call a client gave up on while Triton may still run it is held back for
        # the shipped config's quarantine_s (30 s), and one an idle connection's call still has a
        # view of goes back when that connection's idle time (60 s) ends it: wait past those.
        deadline = time.monotonic() + 75
        while _busy_slots() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _busy_slots(), f"{name}: slots still held after the attack"
    finally:
        callers.resume()
    return verdict


@pytest.mark.parametrize("name", ["grpc-no-answer-window", "grpc-trickled-message", "http-trickled-body"])
def test_slow_or_stalled_clients_hold_no_callers_slots(attacked, name: str) -> None:
    _attack(attacked, name, STALL_BOUNDS)


@pytest.mark.parametrize(
    ("name", "scale"),
    [("http-slow-bodies-past-the-bound", 1.5), ("grpc-unread-answers-past-the-bound", 0.9)],
)
def test_more_slow_clients_than_the_call_bound_refuse_no_caller(attacked, name: str, scale: float) -> None:
    """120 slow HTTP clients, or 72 gRPC ones, more than the two replicas' ``max_ongoing_requests``
    (32 each) together (the replicas share the accept queue, so the HTTP crowd is large enough
    for each to get more than 32): a call counts against the bound only from its whole request
    to its computed answer, so none of them holds it, and no legitimate call is refused."""
    _attack(attacked, name, dataclasses.replace(STALL_BOUNDS, scale=scale))


@pytest.mark.parametrize("name", ["http-trickled-body", "grpc-no-answer-window", "grpc-trickled-message"])
def test_more_slow_clients_than_slots_stop_no_caller(attacked, name: str) -> None:
    """72 slow clients of ``identity``'s slot path, nine times its 8 slots: while other calls wait
    for a slot, a slow client keeps one no longer than ``slot_busy_stall_s`` (0.1 s)."""
    _attack(attacked, name, dataclasses.replace(STALL_BOUNDS, scale=4.5))


def test_connections_of_many_unread_calls_hold_no_callers_workers(attacked) -> None:
    """16 connections of 8 calls each (128 in all, four times the two replicas' 16 gRPC workers
    each) whose answers the client never takes: an answer that waits on its client is parked on
    its connection and its worker freed, so another client's calls on a shared channel still run."""
    _attack(attacked, "grpc-streams-unread", dataclasses.replace(STALL_BOUNDS, scale=1.0))


@pytest.mark.parametrize("name", ["http-answer-unread", "http-json-answers-unread"])
def test_answers_never_read_hold_no_callers_slots(attacked, name: str) -> None:
    """Answers never read (8 binary answers of 16 MiB; 8 answers of a 1 MB tensor as JSON): each is
    copied out of its slot and held, up to the replica's ``http_max_unsent_bytes`` (128 MiB) in
    all; past it the connection ends."""
    _attack(attacked, name, STALL_BOUNDS)


@pytest.mark.parametrize(
    "name",
    [
        "grpc-announced-lengths",
        "http-announced-lengths",
        "grpc-gzip-bomb",
        "h2-huge-headers",
        "h2-continuation-flood",
        "http-json-bodies",
    ],
)
def test_memory_is_not_sized_by_the_client(attacked, name: str) -> None:
    """Buffers grow with the bytes that arrive, within the replica's budgets, and go back when
    freed: 4 clients posting 20 MB JSON bodies over and over, after the module's other attacks,
    leave a replica's memory under the bound (glibc's own moving ``mmap_threshold`` would
    keep the freed bodies in its heaps: ``malloc_mmap_threshold_bytes``)."""
    _attack(attacked, name)


@pytest.mark.parametrize(
    "name", ["http-idle-sockets", "grpc-idle-sockets", "http-half-open-heads", "grpc-half-open-prefaces"]
)
def test_idle_and_half_open_connections_lock_no_caller_out(attacked, name: str) -> None:
    _attack(attacked, name, dataclasses.replace(BOUNDS, scale=0.8))  # 640 idle sockets


def test_reset_calls_do_not_run(attacked) -> None:
    verdict = _attack(attacked, "grpc-reset-calls")
    assert verdict.notes["calls reset"] >= 400 and verdict.notes["ran"] <= 0.05 * verdict.notes["calls reset"]


@pytest.mark.parametrize(
    "name", ["h2-ping-flood", "h2-settings-flood", "h2-empty-data-flood", "h2-window-update-flood"]
)
def test_frame_floods_stop_no_caller(attacked, name: str) -> None:
    _attack(attacked, name)


@pytest.mark.parametrize(
    "name",
    [
        "http-cl-and-te",
        "http-chunk-size-negative",
        "http-chunk-size-overlong",
        "http-bare-lf",
        "http-obs-fold",
        "http-duplicate-content-length",
        "http-space-before-colon",
    ],
)
def test_protocol_faults_are_refused(attacked, name: str) -> None:
    verdict = _attack(attacked, name, dataclasses.replace(BOUNDS, hold_s=0.5, quiet_s=0.5))
    assert verdict.notes["refused"], verdict.notes


def test_the_shipped_app_serves_grpc_with_nghttp2_where_it_was_built(attacked) -> None:
    """``grpc_engine: auto``: the attacks here met nghttp2 where it was built (each engine's
    GOAWAY says which it is)."""
    from ray_triton_shm._private.serve.http2.engine import available

    servers, _, _ = attacked
    assert grpc_engine_serving(servers.frontdoor.grpc_url) == ("nghttp2" if available() else "python")


def test_after_the_attacks_nothing_is_left(attacked) -> None:
    """Last in this module: the callers stop, the app shuts down, and nothing is left in /dev/shm."""
    from ray import serve

    from ray_triton_shm.node import shutdown_node_actors

    servers, callers, where = attacked
    callers.stop()
    serve.shutdown()
    shutdown_node_actors()
    owners = {where["actor_pid"], where["triton_pid"], *servers.replica_pids}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in owners):
        time.sleep(0.5)
    assert not [p for p in owners if psutil.pid_exists(p)], "a server process outlived the shutdown"
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)]
    assert not left, left
