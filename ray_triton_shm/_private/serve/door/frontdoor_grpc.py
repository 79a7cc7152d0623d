"""The front door's gRPC half: Triton's ``inference.GRPCInferenceService`` served by the replica itself.

A lean gRPC server of our own (:class:`~ray_triton_shm._private.serve.http2.h2_listener.H2Listener`:
a thread per connection while it has work, calls on a thread pool, each connection served by
the package's HTTP/2 in Python or by nghttp2 in C; every replica of the app on a node accepts
from one listening socket):

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
import contextlib
import functools
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.door.calls import CallGate, GatedCall
from ray_triton_shm._private.serve.http2.grpc_message import Placement, Placer
from ray_triton_shm._private.serve.http2.h2_listener import H2Listener
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import CallError, H2Limits, StreamGone
from ray_triton_shm._private.serve.net.listener import MAX_OPEN
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
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    LayoutMismatchError,
    OutputTooLargeError,
)

logger = logging.getLogger(__name__)

_PREFIX = f"/{SERVICE}/"


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
        engine: What serves each connection (see :class:`H2Listener`).
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
        engine: str | None = None,
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
            fast=self,
            engine=engine,
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
                parts += [_raw_prefix(placeholder.nbytes), memoryview(target).cast("B")]
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

    # -- placed calls whose request to Triton the connection posts itself ---------------------
    def fast_ready(self) -> bool:
        """Whether :meth:`fast_begin` can hand requests to the connection (shm requests over HTTP)."""
        inner = getattr(self._client, "client", None)
        return bool(getattr(inner, "posts_shm_over_http", False))

    def fast_begin(self, call: Any) -> tuple[_FastCall, str, bytes, float | None] | CallError | None:
        """Begin a placed ``ModelInfer`` as :meth:`handle` would, up to its request to Triton.

        Returns the call's state, Triton's HTTP address, the bytes to post and the answer's
        timeout (then :meth:`fast_finish` with the answer); or the error to answer with;
        ``None``: the client is gone (nothing to answer).
        """
        stack = contextlib.ExitStack()
        gated = stack.enter_context(self._gate.call("grpc", "ModelInfer", call.method))
        try:
            stack.enter_context(gated.running())
            placement = call.placement()
            request, outputs = placement.request
            lease = placement.lease
            stack.enter_context(lease)
            placement.parts.clear()  # no view of the slot outlives the lease
            _still_wanted(call)
            version = self._served_version(request.model_name)
            begun = self._client.begin_run(lease, outputs)
            if begun is None:
                raise GrpcAnswerError("INTERNAL", "shared-memory requests do not go over HTTP here")
            run, address, data, timeout_s = begun
        except BaseException as e:
            error = _fast_error(gated, e)
            stack.close()
            if not isinstance(e, Exception):
                raise
            return error
        fast = _FastCall(
            stack=stack,
            gated=gated,
            call=call,
            request=request,
            lease=lease,
            outputs=outputs,
            version=version,
            run=run,
            wire=(address, data, timeout_s),
        )
        return fast, address, data, timeout_s

    def fast_finish(
        self, fast: _FastCall, code: int, body: bytes, retry: bool
    ) -> tuple[list[Any], Callable[[], None]] | tuple[str, bytes, float | None] | CallError | None:
        """End :meth:`fast_begin`'s call with Triton's answer (``code``: HTTP status, ``-1`` none in
        time, ``-2`` unreachable).

        Returns the answer's parts and what to call once they are written; the request to post
        once more (the pool was registered again); the error to answer with; or ``None``: the
        call goes on in a worker thread, or its client is gone.
        """
        call, request = fast.call, fast.request
        try:
            try:
                result = self._client.finish_run(fast.run, code, body, retry)
            except (LayoutMismatchError, OutputTooLargeError):
                threading.Thread(target=self._fast_fallback, args=(fast,), daemon=True).start()
                return None
            if result is None:
                return fast.wire
            parts = encode_infer_response_parts(request.model_name, fast.version, request.id, result)
            del result
            fast.gated.leave()
            fast.gated.record.status = "OK"
            if call.cancelled:
                fast.stack.close()
                return None
            limits = self._limits
            return (
                parts,
                fast.stack.close,
                slot_stall(fast.lease, limits.slot_stall_s, limits.slot_busy_stall_s),
            )
        except Exception as e:
            error = _fast_error(fast.gated, e)
            fast.stack.close()
            return error

    def _fast_fallback(self, fast: _FastCall) -> None:
        """A fast call whose model changed under it: run as :func:`run_leased` does, in a worker."""
        call = fast.call
        try:
            with fast.stack:
                shapes = list(fast.lease.input_shapes.items())
                inputs = {name: np.array(fast.lease.input(name, shape)) for name, shape in shapes}
                fast.lease.release()
                result = self._client.infer(fast.request.model_name, inputs, outputs=fast.outputs)
                parts = encode_infer_response_parts(
                    fast.request.model_name, fast.version, fast.request.id, result
                )
                fast.gated.leave()
                fast.gated.record.status = "OK"
                call.respond(parts)
        except Exception as e:
            error = _fast_error(fast.gated, e)
            if error is not None:
                call.abort(error.code, error.message)

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


class _FastCall:
    """A placed ``ModelInfer`` between its request to Triton and its answer (:meth:`GrpcDoor.fast_begin`)."""

    __slots__ = ("call", "gated", "lease", "outputs", "request", "run", "stack", "version", "wire")

    def __init__(self, stack, gated, call, request, lease, outputs, version, run, wire) -> None:
        self.stack, self.gated, self.call, self.request, self.lease = stack, gated, call, request, lease
        self.outputs, self.version, self.run, self.wire = outputs, version, run, wire


def _fast_error(gated: GatedCall, e: BaseException) -> CallError | None:
    """What a failed fast call answers, as :meth:`GrpcDoor._answer` would (``None``: the client is gone)."""
    record = gated.record
    if isinstance(e, StreamGone):
        return None
    if isinstance(e, CallError):
        record.status = e.code
        return e
    code, message = status_of(e)  # type: ignore[arg-type]
    record.status = code
    if code == "INTERNAL" and not isinstance(e, GrpcAnswerError):
        logger.warning("front door gRPC: %s", message, exc_info=e)
    return CallError(code, message)


@functools.lru_cache(maxsize=256)
def _raw_prefix(nbytes: int) -> bytes:
    """The field key and length that come before ``nbytes`` of raw input contents."""
    return RAW_INPUT_KEY + encode_varint(nbytes)


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
