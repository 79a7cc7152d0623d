"""The front door's edges, without Ray: a call past the bound over gRPC, the drain's worst case,
a port holder that does not answer, and a process of another user asking for the socket."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.bench.attacks import wire
from ray_triton_shm._private.node.port_claim import HANDOVER_TIMEOUT_S, PortClaim, app_claim_names
from ray_triton_shm._private.serve.door import frontdoor_grpc, frontdoor_http
from ray_triton_shm._private.serve.door.calls import CallGate
from ray_triton_shm._private.serve.door.frontdoor import FrontDoor
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.door.frontdoor_grpc import GrpcDoor
from ray_triton_shm._private.serve.door.frontdoor_http import KServeHttpHandler, error_answer
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.http2.h2_wire import H2Limits
from ray_triton_shm._private.serve.replica_context import CLOSE_S, drain_budget
from ray_triton_shm.errors import UnavailableError
from tests.helpers import free_port, replica_process, stop_process, wait_for

pytestmark = pytest.mark.usefixtures("grpc_engine")  # each test on each engine

_JSON = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]})


def _grpc_infer(port: int, model: str = "m") -> None:
    """One ``ModelInfer`` call of tritonclient's gRPC client (the client closed after it)."""
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        tensor = grpcclient.InferInput("X", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))
        client.infer(model, [tensor], client_timeout=20)


class _NeverRuns:
    """A node client for calls the door must refuse before they run."""

    _recheck = False
    client = SimpleNamespace(_layout_or_none=lambda model: None)

    def infer(self, model, inputs, **kwargs):
        raise AssertionError("a refused call never runs")


class _Echo:
    """A node client whose every call answers its first input (from memory: no slot layout)."""

    _recheck = False
    client = SimpleNamespace(_layout_or_none=lambda model: None)

    def infer(self, model, inputs, **kwargs):
        return {"OUTPUT0": np.array(next(iter(inputs.values())))}


def _grpc_door(client, gate: CallGate | None = None, threads: int = 2, **limits) -> GrpcDoor:
    """A gRPC front door on a free port, over ``client`` (a node client's stand-in), with ``limits``."""
    return GrpcDoor(
        "127.0.0.1",
        0,
        client=client,
        servicer=None,
        served_version=lambda model: "1",
        run=None,
        app_name="app",
        threads=threads,
        gate=gate,
        limits=H2Limits(**limits),
    )


def test_a_full_front_door_answers_grpc_unavailable_as_serves_back_pressure() -> None:
    gate = CallGate(1)
    door = _grpc_door(_NeverRuns(), gate)
    try:
        with gate.running():  # one call running: the bound
            with pytest.raises(InferenceServerException) as refused:
                _grpc_infer(door.port)
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            assert "max_ongoing_requests (1)" in refused.value.message()
        assert (gate.ongoing, gate.refused) == (0, 1)
    finally:
        door.close()
    assert not door.open_connections()


def _call_with_no_answer_window(port: int, x: np.ndarray) -> socket.socket:
    """A whole ``ModelInfer`` call from a client that opens no window for its answer and reads nothing."""
    s = wire.connect("127.0.0.1", port, rcvbuf=4096)
    opening = wire.H2_PREFACE + wire.settings(initial_window_size=0)
    wire.send_quietly(
        s, opening + wire.frame(wire.HEADERS, wire.END_HEADERS, 1, wire.request_block(wire.INFER_PATH))
    )
    framed = wire.grpc_framed(wire.identity_message(x))
    assert wire.send_data(s, 1, framed, time.monotonic() + 10) == len(framed)
    return s


def test_grpc_answers_not_taken_do_not_hold_the_call_bound() -> None:
    """Three calls whose clients take no answer, against a bound of two: each counts only until its
    answer is computed, so all three run and a prompt caller is still answered."""
    gate = CallGate(2)
    door = _grpc_door(_Echo(), gate, slot_stall_s=0.2)
    x = np.arange(1 << 18, dtype=np.float32).reshape(1, -1)  # 1 MiB answers
    sockets = []
    try:
        sockets = [_call_with_no_answer_window(door.port, x) for _ in range(3)]
        assert wait_for(lambda: gate.total == 3 and gate.ongoing == 0), (gate.total, gate.ongoing)
        _grpc_infer(door.port)
        assert (gate.total, gate.refused) == (4, 0)
        assert not any(wire.closed_by_peer(s) for s in sockets)  # still waiting for their windows
        assert wait_for(lambda: door._server.unsent.used >= 3 * x.nbytes)  # held against the budget
    finally:
        wire.close_all(sockets)
        door.close()
    assert wait_for(lambda: door._server.unsent.used == 0)


def test_grpc_answers_not_taken_are_held_up_to_the_listeners_budget_then_their_connections_end() -> None:
    x = np.arange(1 << 18, dtype=np.float32).reshape(1, -1)
    door = _grpc_door(_Echo(), slot_stall_s=0.2, max_unsent_bytes=3 * x.nbytes // 2)  # room for one answer
    sockets = []
    try:
        sockets.append(_call_with_no_answer_window(door.port, x))
        assert wait_for(lambda: door._server.unsent.used >= x.nbytes)
        sockets.append(_call_with_no_answer_window(door.port, x))
        assert wait_for(
            lambda: wire.closed_by_peer(sockets[1])
        )  # no room for its answer: the connection ended
        assert not wire.closed_by_peer(sockets[0])
        _grpc_infer(door.port)  # a caller that takes its answer is served meanwhile
    finally:
        wire.close_all(sockets)
        door.close()
    assert wait_for(lambda: door._server.unsent.used == 0)


def _answers(s: socket.socket, streams: set[int], timeout_s: float = 20.0) -> dict[int, bytes]:
    """Read frames until each of ``streams`` has ended: its DATA bytes; a stream whose trailers are
    not ``grpc-status: 0`` or that is reset fails the test."""
    import hpack

    decoder = hpack.Decoder()
    data = {sid: b"" for sid in streams}
    ended: set[int] = set()
    pending = b""
    s.settimeout(timeout_s)
    while ended != streams:
        while len(pending) < 9 or len(pending) < 9 + int.from_bytes(pending[:3], "big"):
            got = s.recv(1 << 16)
            assert got, f"the server closed the connection; ended {sorted(ended)}"
            pending += got
        length = int.from_bytes(pending[:3], "big")
        kind, flags, sid = pending[3], pending[4], int.from_bytes(pending[5:9], "big") & 0x7FFFFFFF
        payload, pending = pending[9 : 9 + length], pending[9 + length :]
        if kind == wire.DATA:
            data[sid] += payload
        elif kind == wire.HEADERS:
            headers = dict(decoder.decode(payload))
            if flags & wire.END_STREAM:
                assert headers.get("grpc-status") == "0", headers
                ended.add(sid)
        elif kind == wire.RST_STREAM and sid in streams and sid not in ended:
            raise AssertionError(f"stream {sid} reset: {payload.hex()}")
    return data


def _answers_of(s: socket.socket, tensors: dict[int, np.ndarray]) -> dict[int, bytes]:
    """The answers of the streams of ``tensors`` (see :func:`_answers`), each checked to be a whole
    gRPC message (its 5-byte prefix, then that many bytes) echoing its stream's tensor."""
    answers = _answers(s, set(tensors))
    for sid, x in tensors.items():
        assert int.from_bytes(answers[sid][1:5], "big") == len(answers[sid]) - 5
        assert x.tobytes() in answers[sid]
    return answers


def test_grpc_answers_not_taken_on_a_connection_of_many_calls_free_their_workers() -> None:
    """A connection of four calls whose client opens no window for the answers, against a door of two
    workers: each answer waits on its client parked, not in a worker, so another client's calls at once
    on one channel run meanwhile; when the client opens its windows, every parked answer comes whole."""
    door = _grpc_door(_Echo(), slot_stall_s=0.2, send_timeout_s=30.0)
    x = np.arange(1024, dtype=np.float32).reshape(1, -1)
    framed = wire.grpc_framed(wire.identity_message(x))
    streams = {1, 3, 5, 7}
    s = wire.connect("127.0.0.1", door.port, rcvbuf=4096)
    try:
        wire.send_quietly(s, wire.H2_PREFACE + wire.settings(initial_window_size=0))
        wire.server_settings(s)
        calls = b""
        for sid in sorted(streams):
            calls += wire.frame(wire.HEADERS, wire.END_HEADERS, sid, wire.request_block(wire.INFER_PATH))
            calls += wire.frame(wire.DATA, wire.END_STREAM, sid, framed)
        wire.send_quietly(s, calls)
        assert wait_for(lambda: door._server.unsent.used >= 4 * x.nbytes)  # all four parked, held

        done = threading.Semaphore(0)
        errors = []

        def finished(result, error) -> None:
            errors.append(error)
            done.release()

        with grpcclient.InferenceServerClient(f"127.0.0.1:{door.port}") as client:
            for _ in range(2):  # two streams of one connection at once: they run on the workers
                tensor = grpcclient.InferInput("X", [1], "FP32")
                tensor.set_data_from_numpy(np.ones(1, np.float32))
                client.async_infer("m", [tensor], finished, client_timeout=10)
            assert done.acquire(timeout=15) and done.acquire(timeout=15)
        assert errors == [None, None]

        opening = b"".join(
            wire.frame(wire.WINDOW_UPDATE, 0, sid, (1 << 20).to_bytes(4, "big")) for sid in sorted(streams)
        )
        wire.send_quietly(s, opening)
        answers = _answers_of(s, dict.fromkeys(streams, x))
        assert all(answers[sid][0] == 0 for sid in streams)  # uncompressed
        assert wait_for(lambda: door._server.unsent.used == 0)
    finally:
        s.close()
        door.close()
    assert door._server.unsent.used == 0


def test_grpc_parked_answers_stay_held_until_the_socket_takes_them() -> None:
    """A parked 16 MiB answer (and a small one beside it) whose client then opens its windows but reads
    nothing yet: what the socket does not take stays held against the budget until the client reads."""
    door = _grpc_door(_Echo(), slot_stall_s=0.2, send_timeout_s=30.0)
    tensors = {1: np.arange(1 << 22, dtype=np.float32).reshape(1, -1), 3: np.ones((1, 1024), np.float32)}
    s = wire.connect("127.0.0.1", door.port, rcvbuf=4096)
    try:
        wire.send_quietly(s, wire.H2_PREFACE + wire.settings(initial_window_size=0))
        wire.server_settings(s)
        # Both streams open before either message ends: neither call runs in the connection's own
        # thread, so both answers are written by workers and parked.
        calls = b"".join(
            wire.frame(wire.HEADERS, wire.END_HEADERS, sid, wire.request_block(wire.INFER_PATH))
            for sid in (1, 3)
        )
        for sid in (3, 1):
            framed = wire.grpc_framed(wire.identity_message(tensors[sid]))
            pieces = [framed[i : i + (1 << 20)] for i in range(0, len(framed), 1 << 20)]
            for k, piece in enumerate(pieces):  # the server's windows are 2 GiB (read above)
                calls += wire.frame(wire.DATA, wire.END_STREAM if k == len(pieces) - 1 else 0, sid, piece)
        wire.send_quietly(s, calls)
        assert wait_for(lambda: door._server.unsent.used >= sum(x.nbytes for x in tensors.values()))
        grant = (32 << 20).to_bytes(4, "big")
        wire.send_quietly(s, b"".join(wire.frame(wire.WINDOW_UPDATE, 0, sid, grant) for sid in (0, 1, 3)))
        time.sleep(1.0)  # the answers go to the socket as far as it takes them; the rest waits
        assert door._server.unsent.used >= 8 << 20, door._server.unsent.used
        _answers_of(s, tensors)
        assert wait_for(lambda: door._server.unsent.used == 0)
    finally:
        s.close()
        door.close()
    assert door._server.unsent.used == 0


class _SlotLease:
    """A stand-in slot: inputs written into it, given back once."""

    pool = SimpleNamespace(waiting=0)

    def __init__(self, owner: _HeldSlot) -> None:
        self._owner = owner
        self.inputs: dict[str, np.ndarray] = {}
        self._released = False

    def input(self, name: str, shape) -> np.ndarray:
        self.inputs[name] = np.empty(shape, np.float32)
        return self.inputs[name]

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner.released += 1

    def __enter__(self) -> _SlotLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _HeldSlot:
    """A node client of model ``slotted`` whose one slot another call holds until :attr:`free` is set;
    any other model is answered from memory, its first input echoed."""

    _recheck = False
    client = SimpleNamespace(
        _layout_or_none=lambda model: None,
        pool=lambda model: SimpleNamespace(try_acquire=lambda: None, retired=False),
        _pools={},
    )

    def __init__(self) -> None:
        self.free = threading.Event()
        self.waiting = 0
        self.released = 0
        self._lock = threading.Lock()

    def lease(self, model: str) -> _SlotLease:
        with self._lock:
            self.waiting += 1
        assert self.free.wait(30)
        return _SlotLease(self)

    def run(self, lease: _SlotLease, outputs) -> dict[str, np.ndarray]:
        return {"OUTPUT0": next(iter(lease.inputs.values()))}

    def infer(self, model, inputs, **kwargs):
        return {"OUTPUT0": np.array(next(iter(inputs.values())))}


def _slotted(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """Requests of model ``slotted`` run in a slot of ``module``'s door; any other model's from memory."""
    monkeypatch.setattr(module, "shm_plan", lambda client, model, inputs, outputs: model == "slotted")


def test_grpc_calls_waiting_for_a_slot_do_not_hold_the_call_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls wait for the only slot, held elsewhere, against a bound of two: they count only once
    they have it, so another caller is answered meanwhile, and both are answered once it is free."""
    _slotted(monkeypatch, frontdoor_grpc)
    client, gate = _HeldSlot(), CallGate(2)
    door = _grpc_door(client, gate, threads=3)  # a worker for each call
    try:
        with ThreadPoolExecutor(2) as callers:
            waiting = [callers.submit(_grpc_infer, door.port, "slotted") for _ in range(2)]
            assert wait_for(lambda: client.waiting == 2)
            assert (gate.ongoing, gate.waiting) == (0, 2)  # demand for the autoscaler, not the bound
            _grpc_infer(door.port)
            client.free.set()
            for call in waiting:
                call.result(timeout=30)
        assert (gate.total, gate.refused, gate.ongoing, client.released) == (3, 0, 0, 2)
    finally:
        client.free.set()
        door.close()


def test_a_grpc_call_whose_slot_comes_when_the_bound_is_full_is_refused_and_gives_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _slotted(monkeypatch, frontdoor_grpc)
    client, gate = _HeldSlot(), CallGate(1)
    door = _grpc_door(client, gate)
    try:
        with ThreadPoolExecutor(1) as callers:
            waiting = callers.submit(_grpc_infer, door.port, "slotted")
            assert wait_for(lambda: client.waiting == 1)
            with gate.running():  # the bound, reached while the call waits
                client.free.set()
                with pytest.raises(InferenceServerException) as refused:
                    waiting.result(timeout=30)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert "max_ongoing_requests (1)" in refused.value.message()
        assert (gate.refused, gate.ongoing, client.released) == (1, 0, 1)
    finally:
        client.free.set()
        door.close()


def _http_infer_of(port: int, model: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=_JSON)
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        return answer
    finally:
        conn.close()


def test_http_calls_waiting_for_a_slot_do_not_hold_the_call_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP door's JSON requests, as the gRPC test above: not counted while they wait for a slot."""
    _slotted(monkeypatch, frontdoor_http)
    client, gate = _HeldSlot(), CallGate(2)
    door = HttpListener(
        "127.0.0.1", 0, KServeHttpHandler(client, lambda m: "1", None, error_answer, 1 << 20, gate=gate)
    )
    try:
        with ThreadPoolExecutor(2) as callers:
            waiting = [callers.submit(_http_infer_of, door.port, "slotted") for _ in range(2)]
            assert wait_for(lambda: client.waiting == 2)
            assert (gate.ongoing, gate.waiting) == (0, 2)  # demand for the autoscaler, not the bound
            _http_infer_of(door.port, "m")
            client.free.set()
            answers = [call.result(timeout=30) for call in waiting]
        assert all(answer["outputs"][0]["data"] == [1.0] for answer in answers), answers
        assert (gate.total, gate.refused, gate.ongoing, client.released) == (3, 0, 0, 2)
    finally:
        client.free.set()
        door.close()


class _Stuck:
    """A node client whose calls wait for :attr:`release` (a call Triton takes long to answer)."""

    _recheck = False
    client = SimpleNamespace(_layout_or_none=lambda model: None)

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Event()

    def infer(self, model, inputs, **kwargs):
        self.started.release()
        self.release.wait(60)
        raise UnavailableError("released by the test", "UNAVAILABLE", model)


class _Deployment:
    _max_request_bytes = 1 << 20
    _versions = SimpleNamespace(get=lambda model, now: "1")

    def __init__(self, client: _Stuck) -> None:
        self._client = client


def _http_infer(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v2/models/m/infer", body=_JSON)
        conn.getresponse().read()
    finally:
        conn.close()


def test_a_drain_with_calls_that_do_not_end_returns_within_its_time_and_closes_their_connections() -> None:
    # Serve kills a stopping replica graceful_shutdown_timeout_s after it asked it to stop:
    # the drain and the door's close must end within the drain's time and CLOSE_S, however
    # long the calls in flight would take.
    stuck = _Stuck()
    door = FrontDoor(FrontDoorConfig(http_port=0, grpc_port=0), _Deployment(stuck), "app")
    ended: list[str] = []

    def call(name: str, run) -> None:
        try:
            run()
            ended.append(f"{name}: answered")
        except Exception as e:
            ended.append(f"{name}: {type(e).__name__}")

    callers = [
        threading.Thread(target=call, args=("http", lambda: _http_infer(door.http.port))),
        threading.Thread(target=call, args=("grpc", lambda: _grpc_infer(door.grpc.port))),
    ]
    for caller in callers:
        caller.start()
    try:
        for _ in callers:
            assert stuck.started.acquire(timeout=20), "a call did not reach the node client"
        assert door.calls.ongoing == 2
        wait_s = 1.0
        start = time.monotonic()
        drained = door.drain(wait_s)
        took = time.monotonic() - start
        assert drained is False  # the calls were still running
        assert took < wait_s + CLOSE_S + 0.5, f"the drain and close took {took:.2f} s"
        for port in (door.http.port, door.grpc.port):  # no one else held them: the ports closed
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert wait_for(lambda: len(ended) == 2, 10, 0.05), ended  # their connections were closed
        assert not any(e.endswith("answered") for e in ended), ended
    finally:
        stuck.release.set()
        for caller in callers:
            caller.join(20)
        door.close()
    assert wait_for(lambda: door.calls.ongoing == 0, 10, 0.05)  # the cut calls were counted out


def test_the_drain_keeps_within_serves_graceful_shutdown_timeout() -> None:
    def context(graceful_s, wait_loop_s=2.0):
        config = SimpleNamespace(
            graceful_shutdown_timeout_s=graceful_s, graceful_shutdown_wait_loop_s=wait_loop_s
        )
        return SimpleNamespace(_deployment_config=config)

    assert drain_budget(context(20.0), 10.0, 2.0) == 10.0  # Serve's defaults leave the whole drain
    assert drain_budget(context(8.0), 10.0, 2.0) == pytest.approx(8.0 - 2.0 - 2.0 - CLOSE_S)
    assert drain_budget(context(8.0, 0.5), 10.0, 2.0) == pytest.approx(8.0 - 0.5 - 2.0 - CLOSE_S)
    assert drain_budget(context(3.0), 10.0, 2.0) == 0.0
    assert drain_budget(None, 10.0, 2.0) == 10.0  # outside Serve: the door's own setting
    assert drain_budget(context("soon"), 10.0, 2.0) == 10.0


def test_a_holder_that_does_not_answer_is_passed_over_after_the_handover_time() -> None:
    # A replica stopped (SIGSTOP, a debugger) while it holds the app's socket: the next
    # replica asks it, waits HANDOVER_TIMEOUT_S, and binds a socket of its own beside it.
    port = free_port()
    holder, held_inode = replica_process(port)
    claim = None
    sock = None
    try:
        stop_process(holder.pid)  # every thread stopped: none can still answer the claim
        claim = PortClaim(port, "app")
        start = time.monotonic()
        sock = claim.listening_socket("127.0.0.1", "HTTP")
        took = time.monotonic() - start
        assert HANDOVER_TIMEOUT_S <= took < HANDOVER_TIMEOUT_S + 2.0, took
        assert os.fstat(sock.fileno()).st_ino != held_inode  # its own, not the stopped holder's
        assert sock.getsockname() == ("127.0.0.1", port)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the holder is gone: ours takes all
            conn, _ = sock.accept()
            conn.close()
    finally:
        sock.close()
        claim.close()
    assert app_claim_names(port, "app") == []


def _ask_as(uid: int, name: str) -> int:
    """How many file descriptors a process of ``uid`` gets when it asks the claim ``name``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        count = -1
        try:
            os.close(read)
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as asker:
                asker.settimeout(HANDOVER_TIMEOUT_S + 2)
                asker.connect(f"\0{name}")
                _, fds, _, _ = socket.recv_fds(asker, 1, 1)
                count = len(fds)
                for fd in fds:
                    os.close(fd)
        except BaseException:
            count = -2
        finally:
            os.write(write, str(count).encode())
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as answer:
            return int(answer.read())
    finally:
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="asking as another user needs root to switch users")
def test_the_listening_socket_is_handed_only_to_processes_of_the_same_user() -> None:
    port = free_port()
    with PortClaim(port, "app") as claim:
        sock = claim.listening_socket("127.0.0.1", "HTTP")
        try:
            assert _ask_as(os.getuid(), claim.name) == 1  # a replica of this user: the socket
            assert _ask_as(65534, claim.name) == 0  # nobody: the connection closes, no socket
        finally:
            sock.close()
