"""The front door as Serve's replicas need it, without Ray: one shared accept queue, drain, the call bound."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from ray_triton_shm._private.node.held_doors import HeldDoors
from ray_triton_shm._private.node.port_claim import PortClaim, claim_names
from ray_triton_shm._private.serve.autoscaling import FRONTDOOR_ONGOING, frontdoor_autoscaling_policy
from ray_triton_shm._private.serve.door.calls import CallGate
from ray_triton_shm._private.serve.door.frontdoor import FrontDoor
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.door.frontdoor_http import KServeHttpHandler, error_answer
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.net.listener import TcpListener
from ray_triton_shm.errors import OverloadedError
from tests.helpers import replica_process, thread_states, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(name: bytes):
    def serve(conn: socket.socket) -> None:
        conn.sendall(name + b"\n")

    return serve


def _ask(port: int, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(b"x")  # a parked connection is served once it has bytes
        return conn.recv(100)


def test_a_stopped_replica_takes_no_new_connection_the_others_take_them_all() -> None:
    port = _free_port()
    child, inode = replica_process(port)
    listener = None
    claim = None
    try:
        assert _ask(port) == b"child\n"
        claim = PortClaim(port, "app")
        sock = claim.listening_socket("127.0.0.1", "HTTP")
        assert os.fstat(sock.fileno()).st_ino == inode  # handed over, not bound beside it
        listener = TcpListener("127.0.0.1", port, _answer(b"parent"), protocol="HTTP", listening=sock)
        os.kill(child.pid, signal.SIGSTOP)  # a hung replica: every thread stopped before the first call
        try:
            assert wait_for(lambda: set(thread_states(child.pid)) == {"T"}, 10)
            answers = [_ask(port) for _ in range(40)]
        finally:
            os.kill(child.pid, signal.SIGCONT)
        assert answers == [b"parent\n"] * 40
    finally:
        child.kill()
        child.wait()
        if listener is not None:
            listener.close()
        if claim is not None:
            claim.close()
    assert not [n for n in claim_names(port)]


def test_the_port_stays_open_while_one_replica_holds_it() -> None:
    port = _free_port()
    first_claim = PortClaim(port, "app")
    first = TcpListener(
        "127.0.0.1",
        port,
        _answer(b"first"),
        protocol="HTTP",
        listening=first_claim.listening_socket("127.0.0.1", "HTTP"),
    )
    second_claim = PortClaim(port, "app")
    second = TcpListener(
        "127.0.0.1",
        port,
        _answer(b"second"),
        protocol="HTTP",
        listening=second_claim.listening_socket("127.0.0.1", "HTTP"),
    )
    try:
        first_claim.close()
        first.stop_accepting()
        assert {_ask(port) for _ in range(10)} == {b"second\n"}  # the old one left, the port did not
        third_claim = PortClaim(port, "app")  # borrows from the second, the only holder now
        third = TcpListener(
            "127.0.0.1",
            port,
            _answer(b"third"),
            protocol="HTTP",
            listening=third_claim.listening_socket("127.0.0.1", "HTTP"),
        )
        second_claim.close()
        second.close()
        assert {_ask(port) for _ in range(10)} == {b"third\n"}
        third_claim.close()
        third.close()
        with pytest.raises(ConnectionRefusedError):  # the last holder gone: the port closed
            _ask(port)
    finally:
        for each in (first, second):
            each.close()
        first_claim.close()
        second_claim.close()


def _replica(port: int, name: bytes) -> tuple[PortClaim, TcpListener]:
    """A replica's claim of ``port`` and its listener on the app's shared socket, answering ``name``."""
    claim = PortClaim(port, "app")
    listening = claim.listening_socket("127.0.0.1", "HTTP")
    return claim, TcpListener("127.0.0.1", port, _answer(name), protocol="HTTP", listening=listening)


def _leave(replica: tuple[PortClaim, TcpListener]) -> None:
    claim, listener = replica
    claim.close()
    listener.close()


def test_the_node_keeps_the_port_open_between_replicas_and_the_next_one_answers_who_waited() -> None:
    port = _free_port()
    doors = HeldDoors()
    old = _replica(port, b"old")
    new = None
    try:
        assert doors.hold(port, "app", "127.0.0.1", linger_s=60.0)
        _leave(old)  # every old replica gone before a new one starts (a redeploy)
        doors.sweep()
        assert [d["port"] for d in doors.ports()] == [port]
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)  # queued, not refused
        with waiting:
            waiting.sendall(b"x")
            new = _replica(port, b"new")  # borrows the socket from the node
            assert waiting.recv(100) == b"new\n"
        doors.sweep()
        assert doors.ports() == [{"port": port, "app": "app", "replicas_away": False, "listening": True}]
    finally:
        _leave(old)
        if new is not None:
            _leave(new)
        doors.close()
    with pytest.raises(ConnectionRefusedError):
        _ask(port)
    assert claim_names(port) == []


def test_the_node_lets_the_port_go_after_its_linger_time_or_at_once_for_a_deleted_app() -> None:
    ports = [_free_port(), _free_port()]
    doors = HeldDoors()
    try:
        for port in ports:
            replica = _replica(port, b"r")
            assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0)
            _leave(replica)
        doors.drop(ports[1], "app")  # its app is being deleted
        now = time.monotonic()
        assert doors.sweep(now) == [(ports[1], "app")]
        with pytest.raises(ConnectionRefusedError):
            _ask(ports[1])
        assert doors.sweep(now + 29.0) == []
        assert doors.sweep(now + 30.0) == [(ports[0], "app")]
        with pytest.raises(ConnectionRefusedError):
            _ask(ports[0])
        assert doors.ports() == []
    finally:
        doors.close()
    assert [claim_names(port) for port in ports] == [[], []]


def test_a_repeated_hold_takes_the_port_in_a_new_holder_and_keeps_a_drop() -> None:
    port = _free_port()
    replica = _replica(port, b"r")
    first, restarted = HeldDoors(), HeldDoors()
    try:
        assert first.hold(port, "app", "127.0.0.1", linger_s=30.0)
        first.close()  # the node actor died: it holds nothing
        assert restarted.hold(port, "app", "127.0.0.1", linger_s=30.0, again=True)  # a replica's report
        assert [d["port"] for d in restarted.ports()] == [port]
        restarted.drop(port, "app")  # the app is being deleted
        assert restarted.hold(port, "app", "127.0.0.1", linger_s=30.0, again=True)  # a late report
        _leave(replica)
        assert restarted.sweep() == [(port, "app")]  # let go at once all the same
        with pytest.raises(ConnectionRefusedError):
            _ask(port)
    finally:
        _leave(replica)
        first.close()
        restarted.close()
    assert claim_names(port) == []


def test_a_port_moved_to_another_address_strands_no_connection() -> None:
    """A redeploy changed the host: the node lets go of the old address's socket, so that once
    its replicas leave, a connection to that address reaches the new replicas' socket."""
    port = _free_port()
    doors = HeldDoors()
    old = _replica(port, b"old")  # on 127.0.0.1
    claim = PortClaim(port, "app")
    new = (
        claim,
        TcpListener(
            "0.0.0.0",
            port,
            _answer(b"new"),
            protocol="HTTP",
            listening=claim.listening_socket("0.0.0.0", "HTTP"),
        ),
    )
    try:
        assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0)
        assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0, again=True)  # an old replica's report
        assert doors.hold(port, "app", "0.0.0.0", linger_s=30.0)  # the new replica's
        assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0, again=True)  # a late old report: no change
        _leave(old)
        assert _ask(port) == b"new\n"
        assert [d["port"] for d in doors.ports()] == [port]
    finally:
        _leave(old)
        _leave(new)
        doors.close()
    assert claim_names(port) == []


def test_a_socket_destroyed_from_outside_is_let_go_and_the_replicas_new_one_held() -> None:
    """The app's listening socket stops listening (``ss -K``; here ``shutdown``, the same for
    every holder): the replicas' listeners stop (their health checks fail), the node lets go
    of the dead socket, and holds the one their successors bind, so the port stays open
    between replicas again."""
    port = _free_port()
    doors = HeldDoors()
    claim = PortClaim(port, "app")
    listening = claim.listening_socket("127.0.0.1", "HTTP")
    old = (claim, TcpListener("127.0.0.1", port, _answer(b"old"), protocol="HTTP", listening=listening))
    new = None
    try:
        assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0)
        listening.shutdown(socket.SHUT_RDWR)
        assert wait_for(lambda: not old[1].accepting, 10, 0.05)
        assert doors.ports()[0]["listening"] is False
        _leave(old)
        new = _replica(port, b"new")  # the node's socket is passed over: a new one is bound
        assert _ask(port) == b"new\n"
        assert doors.hold(port, "app", "127.0.0.1", linger_s=30.0, again=True)  # the new replica's report
        assert doors.ports() == [{"port": port, "app": "app", "replicas_away": False, "listening": True}]
        _leave(new)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # queued for the next, not refused
            pass
        doors.close()
        with pytest.raises(ConnectionRefusedError):
            _ask(port)
    finally:
        _leave(old)
        if new is not None:
            _leave(new)
        doors.close()
    assert claim_names(port) == []


def test_the_node_holds_nothing_that_no_replica_handed_over() -> None:
    port = _free_port()
    doors = HeldDoors()
    try:
        assert not doors.hold(port, "app", "127.0.0.1", linger_s=30.0)
        assert doors.ports() == [] and claim_names(port) == []
        with pytest.raises(ConnectionRefusedError):
            _ask(port)
        with PortClaim(port, "other"):  # another app's port: not held for this one
            assert not doors.hold(port, "app", "127.0.0.1", linger_s=30.0)
            assert doors.ports() == [] and len(claim_names(port)) == 1
    finally:
        doors.close()


def _echo(conn, head, body) -> None:
    data = body.read_all()
    conn.respond(200, [("content-type", "text/plain")], [data])


def test_drain_ends_kept_alive_connections_after_their_answer() -> None:
    door = HttpListener("127.0.0.1", 0, _echo)
    port = door.port
    busy = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    busy.request("POST", "/", body=b"one")
    first = busy.getresponse()
    assert (first.read(), first.getheader("connection")) == (b"one", None)  # kept alive
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)
    time.sleep(0.3)  # accepted, parked
    drained: list[bool] = []
    drainer = threading.Thread(target=lambda: drained.append(door.drain(5.0, quiet_s=2.0)))
    drainer.start()
    time.sleep(0.3)
    busy.request("POST", "/", body=b"two")  # a request on a connection open before the drain
    second = busy.getresponse()
    assert (second.read(), second.getheader("connection")) == (b"two", "close")
    assert idle.recv(10) == b""  # an idle connection is closed once quiet
    drainer.join(10)
    assert drained == [True]
    with pytest.raises(ConnectionRefusedError):  # no one else held the socket: the port closed
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    busy.close()
    idle.close()
    door.close()


def test_the_call_bound_refuses_past_max_ongoing_requests() -> None:
    gate = CallGate(2)
    with gate.running(), gate.running():
        assert gate.ongoing == 2
        with pytest.raises(OverloadedError, match=r"max_ongoing_requests \(2\)"), gate.running():
            pass
    assert (gate.ongoing, gate.total, gate.refused) == (0, 2, 1)


def test_calls_waiting_for_a_slot_are_demand_for_the_autoscaler_not_the_bound() -> None:
    gate = CallGate(1)
    slot = threading.Event()
    with gate.call("grpc") as holder, holder.running():
        waiters = []
        for _ in range(2):
            call = gate.call("grpc")
            gated = call.__enter__()
            thread = threading.Thread(target=gated.wait_for, args=(slot.wait, lambda taken: None))
            thread.start()
            waiters.append((call, thread))
        assert wait_for(lambda: gate.waiting == 2)
        assert gate.ongoing == 1  # the waiters hold no place in the bound of 1
        with pytest.raises(OverloadedError), gate.running():
            pass
        slot.set()
        for call, thread in waiters:
            thread.join(10)
            call.__exit__(None, None, None)
    assert (gate.ongoing, gate.waiting, gate.total, gate.refused) == (0, 0, 1, 1)


def test_the_demand_reported_is_averaged_over_the_time_since_the_previous_report() -> None:
    now = [100.0]
    gate = CallGate(4, clock=lambda: now[0])
    with gate.running():
        now[0] += 2.0  # one call for 2 s
        with gate.call() as waiting:
            # and a call waiting for a slot for 1 s
            waiting.wait_for(lambda: now.__setitem__(0, now[0] + 1.0), lambda taken: None)
        now[0] += 1.0
    now[0] += 4.0  # nothing for 4 s
    assert gate.mean_demand() == pytest.approx((2 * 1 + 1 * 2 + 1 * 1) / 8)
    with gate.running():
        now[0] += 3.0
        assert gate.mean_demand() == pytest.approx(1.0)  # a new window: only the call running
    assert gate.mean_demand() == pytest.approx(0.0)  # an empty window: what runs now


class _Client:
    def infer(self, model, inputs, **kwargs):
        raise AssertionError("a refused call never runs")


def test_a_full_front_door_answers_503_as_serves_back_pressure() -> None:
    gate = CallGate(1)
    handler = KServeHttpHandler(_Client(), lambda m: "1", None, error_answer, 1 << 20, gate=gate)
    door = HttpListener("127.0.0.1", 0, handler)
    try:
        with gate.running():  # one call running: the bound
            conn = http.client.HTTPConnection("127.0.0.1", door.port, timeout=10)
            body = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
            conn.request("POST", "/v2/models/m/infer", body=body)
            response = conn.getresponse()
            assert response.status == 503
            assert "max_ongoing_requests (1)" in json.loads(response.read())["error"]
            conn.close()
    finally:
        door.close()


class _Deployment:
    _client = None
    _max_request_bytes = 1 << 20


def test_the_doors_health_check_fails_once_it_stops_accepting() -> None:
    door = FrontDoor(FrontDoorConfig(http_port=0), _Deployment(), "app", max_ongoing=4)
    try:
        door.check()
        assert door.stats()["ongoing"] == 0 and door.calls.limit == 4
        door.http.stop_accepting()
        with pytest.raises(Exception, match="no longer accepts connections"):
            door.check()
    finally:
        door.close()


def _ctx(current: int, serve_requests: float, door: list[float], target: float = 2.0) -> SimpleNamespace:
    return SimpleNamespace(
        current_num_replicas=current,
        target_num_replicas=current,
        total_num_requests=serve_requests,
        aggregated_metrics={FRONTDOOR_ONGOING: {f"r{i}": v for i, v in enumerate(door)}},
        config=SimpleNamespace(get_target_ongoing_requests=lambda: target),
    )


def test_the_policy_counts_front_door_calls_as_ongoing_requests() -> None:
    assert frontdoor_autoscaling_policy(_ctx(1, 0.0, [8.0]))[0] == pytest.approx(4.0)  # up
    assert frontdoor_autoscaling_policy(_ctx(2, 2.0, [1.0, 1.0]))[0] == pytest.approx(2.0)
    assert frontdoor_autoscaling_policy(_ctx(3, 0.0, [0.0, 0.0, 0.0]))[0] == 0.0  # down (to min)
    no_door = _ctx(2, 4.0, [])
    no_door.aggregated_metrics = None
    assert frontdoor_autoscaling_policy(no_door)[0] == pytest.approx(2.0)  # Serve's own requests only


def test_an_autoscaled_deployment_gets_the_front_door_policy_unless_it_names_one() -> None:
    from ray_triton_shm.serve import FRONTDOOR_POLICY, with_frontdoor_policy

    policy = {"policy_function": FRONTDOOR_POLICY}
    assert with_frontdoor_policy({"num_replicas": 2}) == {"num_replicas": 2}
    assert with_frontdoor_policy({"num_replicas": "auto"})["autoscaling_config"] == {"policy": policy}
    chosen = with_frontdoor_policy({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    assert chosen["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "policy": policy}
    own = {"autoscaling_config": {"max_replicas": 3, "policy": {"policy_function": "mine:policy"}}}
    assert with_frontdoor_policy(own) == own
