"""The front door's HTTP half: KServe v2 inference read from the socket into slots and answered from them.

HTTP inference (no version asked) is read from the socket straight into a
leased slot (:class:`~ray_triton_shm._private.serve.http1.body.Body`) and
answered from the slot (``sendmsg`` of the output views): one copy of each
tensor each way, as in Triton's own endpoint. A slot never waits on a slow
client: a tensor's bytes not all read into it within ``http_slot_stall_s``
(and as long again per 4 MiB; stalled, or trickling) are copied out, the slot
given back, and the rest read into memory (the general path then); an answer
the client stops taking for ``http_slot_stall_s`` is copied out and finished
from memory once the slot is back; so is an answer from memory, held against
``http_max_unsent_bytes`` while it waits. A request counts against the
deployment's ``max_ongoing_requests`` only from its whole body to its computed
answer: a slow client never holds the bound. Every other HTTP route goes to the
Serve ingress's own handler (the deployment's ``__call__``), so both answer alike.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from ray_triton_shm._private.serve.door.calls import CallGate, GatedCall
from ray_triton_shm._private.serve.http1.body import Body
from ray_triton_shm._private.serve.http1.head import HttpParseError, RequestHead
from ray_triton_shm._private.serve.http1.server import Connection
from ray_triton_shm._private.serve.http1.timing import ConnectionGone
from ray_triton_shm._private.serve.net import bounded
from ray_triton_shm._private.serve.net.bounded import ByteBudget, ByteTurns
from ray_triton_shm._private.serve.protocol import kserve, kserve_errors
from ray_triton_shm._private.serve.protocol.slot_plan import (
    BUSY_STALL_S,
    fast_path_lengths,
    run_leased,
    shm_plan,
    slot_stall,
)
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm.errors import InputError, RefusedError, RequestTooLargeError

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
SLOT_STALL_S = 1.0
"""Longest a leased slot waits on an HTTP client (a body read, an answer write) before it goes back."""
MAX_UNSENT_BYTES = 128 << 20
"""Answers copied out of slots for clients that did not take them, held at once (bytes)."""
MAX_JSON_BYTES = 64 << 20
"""Request JSON decoded at once (bytes): decoded, up to about 3x the text (Python objects)."""
SLOT_PACE_BYTES = 4 << 20
"""A tensor's bytes in a slot get ``SLOT_STALL_S`` more for each this many of them."""


class KServeHttpHandler:
    """The front door's HTTP requests: inference read into slots; every other route to ``delegate``.

    Args:
        client: The replica's :class:`NodeClient`.
        served_version: The version Triton runs for a request without one.
        delegate: Answers any other request: ``(head, body) -> (status, headers, body)``.
        error_answer: The KServe error answer of an exception: ``(status, body)``.
        max_bytes: Largest request body (and inflated body) accepted; larger ones are 413.
        slot_stall_s: Longest a leased slot waits on the client (see
            :attr:`FrontDoorConfig.http_slot_stall_s`).
        gate: Counts the requests running and refuses one past its bound (503).
        max_unsent_bytes: Bytes of answers copied out of slots for clients that did
            not take them, held at once; past it, such a client's connection ends.
        busy_stall_s: ``slot_stall_s`` while other calls wait for a slot of the pool (see
            :attr:`FrontDoorConfig.slot_busy_stall_s`).
        max_json_bytes: Bytes of request JSON decoded at once (see
            :attr:`FrontDoorConfig.http_max_json_bytes`).
    """

    def __init__(
        self,
        client: Any,
        served_version: Any,
        delegate: Any,
        error_answer: Any,
        max_bytes: int,
        *,
        slot_stall_s: float = SLOT_STALL_S,
        gate: CallGate | None = None,
        max_unsent_bytes: int = MAX_UNSENT_BYTES,
        busy_stall_s: float = BUSY_STALL_S,
        max_json_bytes: int = MAX_JSON_BYTES,
    ) -> None:
        self._gate = gate or CallGate()
        self._json = ByteTurns(max_json_bytes)
        self._unsent = ByteBudget(max_unsent_bytes, "the front door's http_max_unsent_bytes")
        self._max_bytes = max_bytes
        self._client = client
        self._served_version = served_version
        self._delegate = delegate
        self._error_answer = error_answer
        self._stall_s = slot_stall_s
        self._busy_stall_s = busy_stall_s

    def __call__(self, conn: Connection, head: RequestHead, body: Body) -> None:
        with self._gate.call("http", head.method, head.path) as call:
            conn.status = 0
            try:
                self._answer(conn, head, body, call)
            finally:
                call.record.status = str(conn.status) if conn.status else ""

    def _answer(self, conn: Connection, head: RequestHead, body: Body, call: GatedCall) -> None:
        try:
            if not body.chunked and body.remaining > self._max_bytes:  # refused before it is read
                raise bounded.too_large("request body", self._max_bytes)
            if head.method == "POST":
                match = _INFER.match(head.path)
                if match and match.group(2) is None:
                    self._infer(conn, match.group(1), head, body, call)
                    return
            data = body.read_all(self._max_bytes)
            with call.running():
                status, headers, payload = self._delegate(head, data)
            del data
            self._respond(conn, status, headers, [payload])
        except (ConnectionGone, HttpParseError):
            raise  # the request's framing is lost (or too slow): the connection answers and closes
        except Exception as e:
            if isinstance(e, RequestTooLargeError):
                conn.keep_alive = False  # the rest of the body is not read
            else:
                try:
                    body.drain(self._max_bytes)  # the client may still be sending: let it finish
                except Exception:
                    conn.keep_alive = False
            status, payload = self._error_answer(e)
            conn.respond(status, [("content-type", "application/json")], [payload])

    def _respond(
        self, conn: Connection, status: int, headers: list[tuple[str, str]], parts: list[Any]
    ) -> None:
        """Write an answer from memory; one the client does not take within ``slot_stall_s`` is held
        against ``max_unsent_bytes`` while it waits (none: the connection ends), ``parts`` emptied."""
        rest = conn.respond(status, headers, parts, self._stall_s, self._unsent)
        parts.clear()
        self._send_rest(conn, rest)

    def _infer(self, conn: Connection, model: str, head: RequestHead, body: Body, call: GatedCall) -> None:
        client = self._client
        lengths = None if body.chunked else fast_path_lengths(head.headers)
        data = bytearray()
        if lengths is not None:
            header_length, body_length = lengths
            prefix = body.read(min(header_length, body_length))
            planned = None
            if len(prefix) == min(header_length, body_length):
                try:
                    planned = kserve.plan_request(prefix, header_length, body_length)
                except (InputError, RefusedError):
                    planned = None  # the general path raises the same error
            if planned is not None and planned[1]:
                decoded, spans = planned
                if shm_plan(client, model, decoded.inputs, decoded.outputs):
                    stalled = self._infer_in_slot(conn, model, prefix, decoded, spans, body, call)
                    if stalled is None:
                        return
                    data = stalled
            if not data:
                data += prefix
        body.read_rest_into(data, self._max_bytes)
        decoded = self._decode(head, data, call)
        del data
        if shm_plan(client, model, decoded.inputs, decoded.outputs):
            version = self._served_version(model)
            lease = call.wait_for(lambda: client.lease(model), _give_back)
            with lease:
                for name, array in decoded.inputs.items():
                    lease.input(name, array.shape)[...] = array
                rest = self._run_and_answer(conn, model, decoded, lease, call, version)
            self._send_rest(conn, rest)
            return
        with call.running():
            headers, parts = self._infer_general(model, decoded)
        self._respond(conn, 200, headers, parts)

    def _decode(self, head: RequestHead, data: bytes | bytearray, call: GatedCall) -> kserve.DecodedRequest:
        """The request of the whole body ``data`` (inflated first, if it is compressed).

        Its JSON is decoded in its turn of ``max_json_bytes``, not counted against the
        call bound while it waits; the decoding counts.
        """
        encoding = (head.headers.get("content-encoding") or "identity").strip().lower()
        if encoding != "identity":
            with call.running():
                data = bounded.inflate(data, encoding, self._max_bytes)
        header_length = kserve.parse_header_length(head.headers.get(kserve.HEADER_LENGTH))
        json_bytes = len(data) if header_length is None else min(header_length, len(data))
        with self._json.turn(json_bytes), call.running():
            return kserve.decode_request(data, header_length)

    def _infer_general(
        self, model: str, decoded: kserve.DecodedRequest
    ) -> tuple[list[tuple[str, str]], list[Any]]:
        """Run ``decoded`` with ``client.infer``: the answer's headers and parts."""
        version = self._served_version(model)
        outputs = self._client.infer(model, decoded.inputs, outputs=decoded.outputs, copy=False)
        host = {name: to_host(value) for name, value in outputs.items()}
        parts, headers = kserve.encode_response_parts(model, decoded, host, version)
        return list(headers.items()), parts

    def _run_and_answer(
        self,
        conn: Connection,
        model: str,
        decoded: kserve.DecodedRequest,
        lease: Any,
        call: GatedCall,
        version: str,
    ) -> Any:
        """Run the inputs in ``lease``'s slot (counted while it runs) and answer from the slot; what
        the client did not take in time comes back, copied out, to send once the slot is back.

        An answer of JSON outputs only is not sent from the slot: the outputs are copied
        out and the slot given back before they are encoded (the Python work of a large
        JSON document) and written at the client's pace.
        """
        with call.running():
            outputs = run_leased(self._client, model, lease, decoded.outputs)
            if not any(decoded.binary_outputs.get(name, decoded.default_binary) for name in outputs):
                outputs = {name: np.array(value) for name, value in outputs.items()}
                lease.release()
            parts, headers = kserve.encode_response_parts(model, decoded, dict(outputs), version)
            del outputs
        stall_s = self._stall_s if lease.released else self._stall(lease)
        rest = conn.respond(200, list(headers.items()), parts, stall_s, self._unsent)
        # No view of the slot outlives the lease: it goes straight back, not pinned.
        del parts
        return rest

    def _send_rest(self, conn: Connection, rest: Any) -> None:
        try:
            conn.send_rest(rest)
        finally:
            self._unsent.give(len(rest))

    def _stall(self, lease: Any) -> float:
        """How long ``lease``'s slot may wait on the client now (shorter while others wait for one)."""
        return slot_stall(lease, self._stall_s, self._busy_stall_s)

    def _slot_time(self, nbytes: int, lease: Any) -> float:
        """How long ``nbytes`` may take to come or go while they hold ``lease``'s slot: the stall
        time, and as long again per 4 MiB (as the gRPC door's messages)."""
        return self._stall(lease) * (1.0 + nbytes / SLOT_PACE_BYTES)

    def _infer_in_slot(
        self,
        conn: Connection,
        model: str,
        prefix: bytes,
        decoded: kserve.DecodedRequest,
        spans: list[kserve.BinarySpan],
        body: Body,
        call: GatedCall,
    ) -> bytearray | None:
        """Lease a slot, read the tensor bytes from the socket into it, run, answer from the slot.

        The slot is held only while the client keeps pace: a read or a write that
        waits ``slot_stall_s`` for it copies the slot's bytes to memory and gives
        the slot back.

        Args:
            conn: The connection.
            model: The model.
            prefix: The body's JSON header (its first bytes, read already).
            decoded: The request, its binary inputs placeholders.
            spans: Where the binary inputs lie in the body, one after another.
            body: The rest of the body.
            call: The call, counted from its whole body to its computed answer.

        Returns:
            ``None`` once answered; or, when the body stalled, the body read so
            far (``prefix`` and the tensor bytes that came), the slot given back.

        Raises:
            InputError: The body is longer than its tensors, or as ``client.run``.
            HttpTimeoutError: The body came too slowly.
            ConnectionGone: The client went, or did not take the answer in time.
            OverloadedError: ``max_ongoing_requests`` calls are working already.
        """
        client = self._client
        version = self._served_version(model)
        lease = call.wait_for(lambda: client.lease(model), _give_back)
        with lease:
            for name, array in decoded.inputs.items():  # JSON inputs of the same request
                if all(span.name != name for span in spans):
                    lease.input(name, array.shape)[...] = array
            filled: list[memoryview] = []
            for span in spans:
                target = lease.input(span.name, decoded.inputs[span.name].shape)
                view = memoryview(target.reshape(-1).view(np.uint8))
                del target
                # Asked again each busy-stall tick: shorter once other calls wait for a slot.
                allowed = functools.partial(self._slot_time, len(view), lease)
                got = body.readinto(view, allowed, self._busy_stall_s)
                filled.append(view[:got])
                if got < len(view):  # the client stalled: what came goes to memory, the slot back
                    data = bytearray(prefix)
                    for part in filled:
                        data += part
                    del view, filled, part
                    return data
                del view
            del filled
            if body.remaining:
                raise InputError("the request body is longer than its tensors")
            rest = self._run_and_answer(conn, model, decoded, lease, call, version)
        self._send_rest(conn, rest)
        return None


def error_answer(error: Exception) -> tuple[int, bytes]:
    """The KServe error answer of ``error`` (as the Serve ingress answers it)."""
    return kserve_errors.error_answer(error)


def _give_back(lease: Any) -> None:
    lease.release()
