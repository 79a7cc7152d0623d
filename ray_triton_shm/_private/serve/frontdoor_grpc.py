"""The front door's gRPC half: Triton's ``inference.GRPCInferenceService`` served by the replica itself.

A lean gRPC server of our own (:mod:`~ray_triton_shm._private.serve.grpc_h2`:
HTTP/2 on blocking sockets, a thread per connection, calls on a thread pool;
``SO_REUSEPORT``, so every replica of the app on a node shares the port):

* ``ModelInfer`` takes the request's bytes as they came off the socket: the raw
  input contents are never parsed into a message (:func:`split_infer_request`
  leaves them as views of those bytes); each is copied once, into the slot. The
  outputs are copied once out of the slot (so that it goes back at once, before
  the answer is sent), and the answer is the response message's small fields
  followed by those copies, sent as they are (:func:`encode_infer_response_parts`).
* Every other RPC is the Serve ingress's own method (of
  :class:`~ray_triton_shm._private.serve.kserve_grpc.KServeGrpcMixin`), run on the
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

from ray_triton_shm._private.serve.grpc_h2 import H2Connection, Refuse
from ray_triton_shm._private.serve.h2_wire import Call, CallError
from ray_triton_shm._private.serve.kserve_grpc import (
    SERVICE,
    GrpcAnswerError,
    add_outputs,
    decode_infer_request,
    status_of,
)
from ray_triton_shm._private.serve.kserve_grpc_routes import STREAM_REFUSED
from ray_triton_shm._private.serve.kserve_http import shm_plan
from ray_triton_shm._private.serve.listener import TcpListener
from ray_triton_shm.errors import InputError, LayoutError, LayoutMismatchError, OutputTooLargeError

logger = logging.getLogger(__name__)

_RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_KEY = bytes([(6 << 3) | 2])  # ModelInferResponse.raw_output_contents, length-delimited
_PREFIX = f"/{SERVICE}/"


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise InputError("the ModelInferRequest message is malformed (a varint runs past its end)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_infer_request(data: bytes) -> tuple[pb.ModelInferRequest, list[memoryview]]:
    """The request without its raw input contents, and those contents as views of ``data``.

    Raises:
        InputError: ``data`` is not a well-formed message.
    """
    view = memoryview(data)
    kept: list[tuple[int, int]] = []
    raw: list[memoryview] = []
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(view, pos)
            end = pos + length
            if end > len(view):
                raise InputError("the ModelInferRequest message is malformed (a field runs past its end)")
            if field == _RAW_INPUT_FIELD:
                raw.append(view[pos:end])
                pos = end
                continue
            pos = end
        elif wire == 0:
            _, pos = _varint(view, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise InputError(f"the ModelInferRequest message is malformed (wire type {wire})")
        if kept and kept[-1][1] == start:
            kept[-1] = (kept[-1][0], pos)
        else:
            kept.append((start, pos))
    if pos > len(view):
        raise InputError("the ModelInferRequest message is malformed (it ends inside a field)")
    rest = b"".join(view[a:b] for a, b in kept)
    try:
        return pb.ModelInferRequest.FromString(rest), raw
    except Exception as e:  # protobuf's DecodeError
        raise InputError(f"the ModelInferRequest message is malformed: {e}") from e


def encode_infer_response_parts(
    model: str, version: str, request_id: str, outputs: Mapping[str, Any]
) -> list[bytes | memoryview]:
    """A ``ModelInferResponse`` of ``outputs`` (raw contents) as parts: its small fields, then each output.

    The outputs' parts are views of their arrays: sent as they are, they are
    never joined into one message.
    """
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    parts: list[bytes | memoryview] = []
    for blob in add_outputs(response, outputs):
        parts.extend((_RAW_OUTPUT_KEY, encode_varint(len(blob)), blob))
    return [response.SerializeToString(), *parts]


class H2Listener(TcpListener):
    """A gRPC server on ``host:port`` (``SO_REUSEPORT``): a thread per connection, calls on a pool.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Runs each call (a :class:`Call`), in one of ``threads`` worker threads.
        refuse: See :class:`H2Connection`.
        threads: Calls run at once.
        max_message: Largest request message accepted.
        max_connections: Connections served at once; more wait in the backlog.

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
        threads: int = 16,
        max_message: int = 2**31 - 1,
        max_connections: int = 256,
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc")
        self._connections: set[H2Connection] = set()
        self._connections_lock = threading.Lock()

        def serve(sock: socket.socket) -> None:
            connection = H2Connection(sock, handler, refuse, self._pool, max_message)
            with self._connections_lock:
                self._connections.add(connection)
            try:
                connection.serve()
            finally:
                with self._connections_lock:
                    self._connections.discard(connection)

        try:
            super().__init__(host, port, serve, protocol="gRPC", max_connections=max_connections)
        except BaseException:
            self._pool.shutdown(wait=False)
            raise

    def close(self, grace_s: float = 1.0) -> None:
        """Stop listening; tell every client to go away; wait up to ``grace_s`` for calls running."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            connection.go_away()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c.busy() for c in connections):
            time.sleep(0.02)
        super().close()  # shuts every connection
        self._pool.shutdown(wait=True, cancel_futures=True)


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
        max_connections: Connections served at once (a thread each); more wait in the backlog.

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
        max_connections: int = 256,
    ) -> None:
        self._client = client
        self._servicer = servicer
        self._served_version = served_version
        self._run = run
        self.app_name = app_name
        self._server = H2Listener(
            host, port, self.handle, refuse=self.refuse, threads=threads, max_connections=max_connections
        )
        self.host = host
        self.port = self._server.port

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

    def handle(self, call: Call) -> None:
        """Answer one call (its method was accepted by :meth:`refuse`)."""
        name = call.method[len(_PREFIX) :]
        try:
            if name == "ModelInfer":
                self.infer(call)
                return
            request_cls, _ = _messages(name)  # type: ignore[misc]
            try:
                request = request_cls.FromString(bytes(call.request()))
            except CallError:
                raise
            except Exception as e:  # protobuf's DecodeError
                raise InputError(f"the {name}Request message is malformed: {e}") from e
            response = self._run(getattr(self._servicer, name)(request, None))
            call.respond([response.SerializeToString()])
        except CallError:
            raise
        except Exception as e:
            code, message = status_of(e)
            if code == "INTERNAL" and not isinstance(e, GrpcAnswerError):
                logger.warning("front door gRPC: %s", message, exc_info=e)
            raise CallError(code, message) from e

    def infer(self, call: Call) -> None:
        """Answer a ``ModelInfer`` call: through one slot, answered from it, where the request fits one.

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError, GrpcAnswerError.
        """
        data = call.request()
        request, raw = split_infer_request(data)
        inputs, outputs = decode_infer_request(request, raw)
        model = request.model_name
        if not request.model_version and shm_plan(self._client, model, inputs, outputs):
            self._infer_in_slot(call, request, inputs, outputs)
            return
        if not request.model_version:
            try:
                result = self._client.infer(model, inputs, outputs=outputs)
            except LayoutError:  # tensors that cannot live in slots: Triton's own answer
                result = None
            if result is not None:
                version = self._served_version(model)
                call.respond(encode_infer_response_parts(model, version, request.id, result))
                return
        # A version asked for (Triton honours it) or no slots: the ingress's own path.
        del inputs, raw
        full = pb.ModelInferRequest.FromString(bytes(data))
        call.respond([self._run(self._servicer.ModelInfer(full, None)).SerializeToString()])

    def _infer_in_slot(
        self,
        call: Call,
        request: pb.ModelInferRequest,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] | None,
    ) -> None:
        """Lease a slot, copy the inputs in, run, answer from the slot (no copy of the outputs)."""
        client = self._client
        model = request.model_name
        version = self._served_version(model)
        with client.lease(model) as lease:
            for name, array in inputs.items():
                lease.input(name, array.shape)[...] = array
            try:
                result = client.run(lease, outputs)
            except (LayoutMismatchError, OutputTooLargeError) as e:
                # What infer handles itself (a reloaded model, an output over its slot).
                lease.release()
                if isinstance(e, LayoutMismatchError):
                    client._layout_changed(e)
                result = client.infer(model, inputs, outputs=outputs)
            parts = encode_infer_response_parts(model, version, request.id, result)
            del result
            call.respond(parts)  # written from the slot, then it goes back
            del parts  # no view of the slot outlives the lease


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
