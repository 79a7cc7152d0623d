"""The front door's gRPC half: Triton's ``inference.GRPCInferenceService`` served by the replica itself.

A lean gRPC server of our own (:mod:`~ray_triton_shm._private.serve.http2.grpc_h2`:
HTTP/2 on blocking sockets, a thread per connection while it has work, calls on a
thread pool; every replica of the app on a node accepts from one listening socket):

* ``ModelInfer``: the request's description (the fields before its raw input
  contents) is read first, and :meth:`GrpcDoor.place` leases a slot of the model
  if one is free that moment; the raw contents are then read from the socket
  straight into the slot (:mod:`~ray_triton_shm._private.serve.http2.grpc_message`).
  Otherwise the message is read into a buffer, its raw contents kept as views of
  it (:func:`~ray_triton_shm._private.serve.protocol.grpc_infer_codec.split_infer_request`):
  a request that fits one slot is copied into it, any other takes the node
  client's general path. A request run in a slot is answered from it: the
  response's small fields followed by the outputs' bytes in the slot, sent as
  they are; the slot goes back once they are sent.
* Every other RPC is the Serve ingress's own method (of
  :class:`~ray_triton_shm._private.serve.ingress.kserve_grpc.KServeGrpcMixin`), run on the
  front door's event loop, so both ingresses answer alike.

A request whose ``application`` metadata names another app is refused
(``NOT_FOUND``): each app's front door has ports of its own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.door.calls import CallGate, GatedCall
from ray_triton_shm._private.serve.http2.grpc_h2 import H2Connection
from ray_triton_shm._private.serve.http2.grpc_message import Placement, Placer
from ray_triton_shm._private.serve.http2.h2_receive import Refuse
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import CallError, H2Limits, StreamGone
from ray_triton_shm._private.serve.net.bounded import ByteBudget
from ray_triton_shm._private.serve.net.listener import MAX_OPEN, TcpListener
from ray_triton_shm._private.serve.protocol.grpc_infer_codec import (
    RAW_INPUT_KEY,
    encode_infer_response_parts,
    encode_varint,
    plan_inputs,
    raw_start,
    split_infer_request,
)
from ray_triton_shm._private.serve.protocol.grpc_messages import decode_infer_request, status_of
from ray_triton_shm._private.serve.protocol.kserve_grpc_routes import SERVICE, STREAM_REFUSED, GrpcAnswerError
from ray_triton_shm._private.serve.protocol.slot_plan import (
    PlanCache,
    SlotPlan,
    run_leased,
    shm_plan,
    slot_stall,
)
from ray_triton_shm.errors import InputError, LayoutError

logger = logging.getLogger(__name__)

_PREFIX = f"/{SERVICE}/"


class H2Listener(TcpListener):
    """A gRPC server on ``host:port``: a thread per busy connection, calls on a pool.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Runs each call (a :class:`Call`), in one of ``threads`` worker threads.
        refuse: See :class:`H2Connection`.
        place: See :class:`H2Connection`.
        threads: Calls run at once; as many again for calls whose message is already in a
            slot (they run apart, never waiting behind calls that wait for a slot).
        limits: What each connection may cost (see :class:`H2Limits`).
        max_connections: Connections served at once; more wait in the backlog.
        max_open: Connections open at once, idle ones included.
        listening: A listening socket to accept from instead of binding one.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[Call], None],
        *,
        refuse: Refuse | None = None,
        place: Callable[[str], Placer | None] | None = None,
        threads: int = 16,
        limits: H2Limits | None = None,
        max_connections: int = 256,
        listening: socket.socket | None = None,
        max_open: int = MAX_OPEN,
    ) -> None:
        limits = limits or H2Limits()
        self.budget = ByteBudget(limits.max_buffered_bytes, "the listener's max_buffered_bytes")
        self.unsent = ByteBudget(limits.max_unsent_bytes, "the listener's max_unsent_bytes")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc")
        self._held_pool = ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc-held")
        self._connections: dict[socket.socket, H2Connection] = {}
        self._connections_lock = threading.Lock()

        def serve(sock: socket.socket) -> float | None:
            with self._connections_lock:
                connection = self._connections.get(sock)
                if connection is None:
                    connection = self._connections[sock] = H2Connection(
                        sock,
                        handler,
                        refuse,
                        self._pool,
                        limits,
                        place,
                        self.budget,
                        self._held_pool,
                        self.unsent,
                    )
            wait = None
            try:
                wait = connection.serve()
            finally:
                if wait is None:
                    with self._connections_lock:
                        self._connections.pop(sock, None)
            return wait

        def expire(sock: socket.socket) -> None:
            with self._connections_lock:
                connection = self._connections.pop(sock, None)
            if connection is not None:
                connection.expire()

        try:
            super().__init__(
                host,
                port,
                serve,
                protocol="gRPC",
                max_connections=max_connections,
                max_open=max_open,
                first_wait_s=limits.preface_timeout_s,
                expire=expire,
                listening=listening,
            )
        except BaseException:
            self._pool.shutdown(wait=False)
            self._held_pool.shutdown(wait=False)
            raise

    def drain(self, wait_s: float, quiet_s: float = 0.5) -> bool:
        """Stop accepting, send every connection GOAWAY, and let its calls finish (see ``TcpListener``)."""
        self.stop_accepting(wait_s)
        with self._connections_lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.go_away()
        return super().drain(wait_s, quiet_s)

    def close(self, grace_s: float = 1.0) -> None:
        """Stop listening; tell every client to go away; wait up to ``grace_s`` for calls running.

        Then every connection is shut. Returns within about ``grace_s``: a call
        still running then (Triton has not answered) is left to end on its own,
        with no connection to answer on.
        """
        deadline = time.monotonic() + grace_s
        self.stop_accepting(grace_s)
        with self._connections_lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.go_away()
        while time.monotonic() < deadline and any(c.busy() for c in connections):
            time.sleep(0.02)
        super().close(max(0.0, deadline - time.monotonic()))  # shuts every connection
        idle = not any(c.busy() for c in connections)
        self._pool.shutdown(wait=idle, cancel_futures=True)
        self._held_pool.shutdown(wait=idle, cancel_futures=True)


class GrpcDoor:
    """The gRPC server of one replica's front door.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        client: The replica's :class:`NodeClient`.
        servicer: The object whose ``KServeGrpcMixin`` methods answer the other RPCs.
        served_version: The version Triton runs for a request without one.
        run: Runs a coroutine on the front door's event loop and returns its result.
        app_name: This app's name (checked against the ``application`` metadata).
        threads: Requests served at once.
        limits: What each connection may cost (see :class:`H2Limits`); its ``max_message`` is
            the node's ``max_request_bytes``.
        max_connections: Connections served at once (a thread each); more wait in the backlog.
        gate: Counts the calls running and refuses one past its bound (``UNAVAILABLE``).
        max_open: Connections open at once, idle ones included.
        listening: A listening socket to accept from instead of binding one.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client: Any,
        servicer: Any,
        served_version: Callable[[str], str],
        run: Callable[[Any], Any],
        app_name: str,
        threads: int,
        limits: H2Limits | None = None,
        max_connections: int = 256,
        gate: CallGate | None = None,
        listening: socket.socket | None = None,
        max_open: int = MAX_OPEN,
    ) -> None:
        self._gate = gate or CallGate()
        self._limits = limits or H2Limits()
        self._client = client
        self._servicer = servicer
        self._served_version = served_version
        self._run = run
        self._plans = PlanCache()
        self.app_name = app_name
        self._server = H2Listener(
            host,
            port,
            self.handle,
            refuse=self.refuse,
            place=self.placer,
            threads=threads,
            limits=self._limits,
            max_connections=max_connections,
            listening=listening,
            max_open=max_open,
        )
        self.host = host
        self.port = self._server.port

    @property
    def accepting(self) -> bool:
        """Whether new connections are still taken."""
        return self._server.accepting

    def open_connections(self) -> list[socket.socket]:
        """The connections open now, idle ones included."""
        return self._server.open_connections()

    def drain(self, wait_s: float) -> bool:
        """Stop accepting, GOAWAY to every client, let calls finish; see :meth:`H2Listener.drain`."""
        return self._server.drain(wait_s)

    def close(self, grace_s: float = 1.0) -> None:
        """Stop the server; returns when it no longer listens."""
        self._server.close(grace_s)

    # -- RPCs ---------------------------------------------------------------
    def refuse(self, method: str, metadata: Sequence[tuple[str, str]]) -> CallError | None:
        """Why a call is refused as soon as its headers arrive (``None``: it is taken).

        Another app's ``application`` metadata: ``NOT_FOUND``; ``ModelStreamInfer``
        and methods the service does not have: ``UNIMPLEMENTED``.
        """
        for key, value in metadata:
            if key == "application" and value != self.app_name:
                return CallError(
                    "NOT_FOUND",
                    f"application {value!r} is not served on this port: it is application"
                    f" {self.app_name!r}'s front door (each application has ports of its own)",
                )
        name = method[len(_PREFIX) :] if method.startswith(_PREFIX) else None
        if name == "ModelStreamInfer":
            return CallError("UNIMPLEMENTED", STREAM_REFUSED)
        if name is None or (name != "ModelInfer" and _messages(name) is None):
            return CallError("UNIMPLEMENTED", f"Method not found: {method}")
        return None

    def placer(self, method: str) -> Placer | None:
        """``ModelInfer``'s requests are placed by :meth:`place`; other methods' are read into buffers."""
        return self.place if method == _PREFIX + "ModelInfer" else None

    def place(self, head: bytes, length: int) -> Placement | None:
        """Where a ``ModelInfer`` message's raw input contents go: a slot of its model, free now.

        ``head`` holds the fields before the first raw input (the request's
        description). ``None`` (the message is read into a buffer, and the
        call answered as any other) for anything but a request a slot serves
        as it is: no raw contents after the description, a version asked
        for, inputs the model refuses, no slot free this moment.
        """
        start = raw_start(head)
        if start is None:
            return None
        description = head[:start]
        plan = self._plans.get(self._client, description) or self._plan(description)
        if plan is None:
            return None
        try:
            lease = plan.pool.try_acquire()
        except Exception:  # a pool closed under the call: the general path answers it in Triton's words
            return None
        if lease is None:
            return None
        try:
            parts: list[bytes | memoryview] = []
            for name, placeholder in plan.placeholders.items():
                target = lease.input(name, placeholder.shape)
                parts += [RAW_INPUT_KEY + encode_varint(placeholder.nbytes), memoryview(target).cast("B")]
                del target
            pool = lease.pool
            request = (plan.request, plan.outputs)
            return Placement(lease, description, parts, request, lambda: bool(pool.waiting))
        except Exception:
            lease.release()
            return None

    def _plan(self, description: bytes) -> SlotPlan | None:
        """Plan a request of ``description`` (kept in the door's plans), or ``None``: not through a slot."""
        try:
            request = pb.ModelInferRequest.FromString(description)
            planned = plan_inputs(request)
            if planned is None or request.model_version:
                return None
            placeholders, outputs = planned
            model = request.model_name
            if not shm_plan(self._client, model, placeholders, outputs):
                return None
            inner = self._client.client
            pool = inner.pool(model)
        except Exception:  # anything the call itself would refuse: it is refused there, in Triton's words
            return None
        wanted = None if outputs is None else tuple(outputs)
        plan = SlotPlan(request=request, placeholders=placeholders, outputs=wanted, pool=pool, inner=inner)
        self._plans.put(description, plan)
        return plan

    def handle(self, call: Call) -> None:
        """Answer one call (its method was accepted by :meth:`refuse`)."""
        name = call.method[len(_PREFIX) :]
        with self._gate.call("grpc", name, call.method) as gated:
            self._answer(call, name, gated)

    def _answer(self, call: Call, name: str, gated: GatedCall) -> None:
        record = gated.record
        try:
            # Counted from the whole request to the computed answer (each path leaves the
            # gate before its answer is written: the client's pace, not the replica's work).
            with gated.running():
                self._handle(call, name, gated)
            record.status = "OK"
        except CallError as e:
            record.status = e.code
            raise
        except StreamGone:
            raise
        except Exception as e:
            code, message = status_of(e)
            record.status = code
            if code == "INTERNAL" and not isinstance(e, GrpcAnswerError):
                logger.warning("front door gRPC: %s", message, exc_info=e)
            raise CallError(code, message) from e

    def _handle(self, call: Call, name: str, gated: GatedCall) -> None:
        if name == "ModelInfer":
            self.infer(call, gated)
            return
        request_cls, _ = _messages(name)  # type: ignore[misc]
        try:
            request = request_cls.FromString(bytes(call.request()))
        except CallError:
            raise
        except Exception as e:  # protobuf's DecodeError
            raise InputError(f"the {name}Request message is malformed: {e}") from e
        response = self._run(getattr(self._servicer, name)(request, None)).SerializeToString()
        gated.leave()
        call.respond([response])

    def infer(self, call: Call, gated: GatedCall) -> None:
        """Answer a ``ModelInfer`` call: through one slot, answered from it, where the request fits one.

        Args:
            call: The call.
            gated: The call as the gate counts it; left once the answer is computed.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError, GrpcAnswerError.
        """
        placement = call.placement()
        if placement is not None:
            self._infer_placed(call, placement, gated)
            return
        data = call.request()
        request, raw = split_infer_request(data)
        inputs, outputs = decode_infer_request(request, raw)
        model = request.model_name
        _still_wanted(call)
        if not request.model_version and shm_plan(self._client, model, inputs, outputs):
            self._infer_in_slot(call, request, inputs, outputs, gated)
            return
        if not request.model_version:
            try:
                result = self._client.infer(model, inputs, outputs=outputs)
            except LayoutError:  # tensors that cannot live in slots: Triton's own answer
                result = None
            if result is not None:
                version = self._served_version(model)
                parts = encode_infer_response_parts(model, version, request.id, result)
                del result
                gated.leave()
                call.respond(parts)
                return
        # A version asked for (Triton honours it) or no slots: the ingress's own path.
        del inputs, raw
        full = pb.ModelInferRequest.FromString(bytes(data))
        del data
        answer = self._run(self._servicer.ModelInfer(full, None)).SerializeToString()
        del full
        gated.leave()
        call.respond([answer])

    def _infer_placed(self, call: Call, placement: Placement, gated: GatedCall) -> None:
        """Run a request whose inputs were read into a slot; answer from the slot."""
        request, outputs = placement.request
        lease = placement.lease
        with lease:
            placement.parts.clear()  # no view of the slot outlives the lease
            self._run_and_answer(call, request, lease, outputs, gated)

    def _infer_in_slot(
        self,
        call: Call,
        request: pb.ModelInferRequest,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] | None,
        gated: GatedCall,
    ) -> None:
        """Lease a slot (not counted while it waits for one), copy the inputs in, run, answer from
        the slot (no copy of the outputs)."""
        lease = gated.wait_for(lambda: self._client.lease(request.model_name), lambda lease: lease.release())
        with lease:
            for name, array in inputs.items():
                lease.input(name, array.shape)[...] = array
            self._run_and_answer(call, request, lease, outputs, gated)

    def _run_and_answer(
        self,
        call: Call,
        request: pb.ModelInferRequest,
        lease: Any,
        outputs: Sequence[str] | None,
        gated: GatedCall,
    ) -> None:
        """Run the model on the inputs in ``lease``'s slot and answer from the slot."""
        model = request.model_name
        version = self._served_version(model)
        _still_wanted(call)
        result = run_leased(self._client, model, lease, outputs)
        parts = encode_infer_response_parts(model, version, request.id, result)
        del result
        gated.leave()
        # Written from the slot, then it goes back; sooner, from a copy, if the client takes it slowly.
        limits = self._limits
        call.respond(parts, lease.release, slot_stall(lease, limits.slot_stall_s, limits.slot_busy_stall_s))
        del parts  # no view of the slot outlives the lease


def _still_wanted(call: Call) -> None:
    """Raise :class:`StreamGone` for a call its client reset or left: Triton is not asked to run it.

    Raises:
        StreamGone: The call was cancelled.
    """
    if call.cancelled:
        raise StreamGone()


def _messages(name: str) -> tuple[Any, Any] | None:
    """The request and response classes of the service's method ``name`` (``None``: no such method)."""
    request_cls = getattr(pb, f"{name}Request", None)
    response_cls = getattr(pb, f"{name}Response", None)
    if request_cls is None or response_cls is None:
        return None
    return request_cls, response_cls


def run_on(loop: asyncio.AbstractEventLoop) -> Callable[[Any], Any]:
    """A function that runs a coroutine on ``loop`` (another thread's) and returns its result."""

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    return run
