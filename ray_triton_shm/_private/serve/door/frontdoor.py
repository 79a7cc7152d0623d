"""The front door: each replica's own KServe v2 listeners (HTTP and gRPC) on the app's stable ports.

Clients outside Ray (``tritonclient.http``, ``tritonclient.grpc``) reach the
replica without Serve's proxy in between. Every replica of the app on a node
binds the same ports (``SO_REUSEPORT``): the kernel spreads the connections
among them, and any node's address works on a multi-node cluster (bind
``0.0.0.0`` there). A replica of another app given the same port refuses to
start (:mod:`~ray_triton_shm._private.serve.door.port_claim`). The listeners run in
the replica's process, in threads of their own (blocking sockets, one thread
per connection; gRPC calls that share a connection run on a thread pool), and
close with the replica.

HTTP inference (no version asked) is read from the socket straight into a
leased slot (:class:`~ray_triton_shm._private.serve.http1.body.Body`) and
answered from the slot (``sendmsg`` of the output views): one copy of each
tensor each way, as in Triton's own endpoint. A slot never waits on a slow
client: a tensor's bytes not all read into it within ``http_slot_stall_s``
(and as long again per 4 MiB; stalled, or trickling) are copied out, the slot
given back, and the rest read into memory (the general path then); an answer
the client stops taking for ``http_slot_stall_s`` is copied out and finished
from memory once the slot is back. Every other HTTP route goes to
the Serve ingress's own handler (the deployment's ``__call__``), so both
answer alike. gRPC: see :mod:`ray_triton_shm._private.serve.door.frontdoor_grpc`.

Configured in the app's args::

    args:
      frontdoor: {host: 127.0.0.1, http_port: 8080, grpc_port: 8081}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from starlette.requests import Request

from ray_triton_shm._private.serve.door.frontdoor_grpc import GrpcDoor, run_on
from ray_triton_shm._private.serve.door.port_claim import PortClaim
from ray_triton_shm._private.serve.http1.body import Body
from ray_triton_shm._private.serve.http1.head import HttpParseError, RequestHead
from ray_triton_shm._private.serve.http1.server import Connection, HttpListener
from ray_triton_shm._private.serve.http1.timing import ConnectionGone, HttpTimeouts
from ray_triton_shm._private.serve.http2.h2_wire import IDLE_TIMEOUT_S, MAX_HEADER_BLOCK, H2Limits
from ray_triton_shm._private.serve.net import bounded
from ray_triton_shm._private.serve.protocol import kserve, kserve_errors
from ray_triton_shm._private.serve.protocol.slot_plan import fast_path_lengths, run_leased, shm_plan
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm.config import env_field
from ray_triton_shm.errors import (
    ConfigError,
    InputError,
    RequestTooLargeError,
)

logger = logging.getLogger(__name__)

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
_CALL_TIMEOUT_S = 120.0
SLOT_STALL_S = 1.0
"""Longest a leased slot waits on an HTTP client (a body read, an answer write) before it goes back."""
SLOT_PACE_BYTES = 4 << 20
"""A tensor's bytes in a slot get ``SLOT_STALL_S`` more for each this many of them."""


def _optional_port(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "off") else int(text)


_HTTP_DEFAULTS = HttpTimeouts()
_HTTP_SECONDS = (
    "http_head_timeout_s",
    "http_idle_timeout_s",
    "http_body_grace_s",
    "http_body_min_rate",
    "http_send_timeout_s",
    "http_slot_stall_s",
)


@dataclass(frozen=True, kw_only=True)
class FrontDoorConfig:
    """Where a replica's own KServe v2 listeners listen (explicit > ``RAY_TRITON_SHM_FRONTDOOR_*`` > default).

    Attributes:
        host: Address the listeners bind: ``127.0.0.1`` (this machine only) or
            ``0.0.0.0`` (every interface: what a multi-node cluster needs).
        http_port: KServe v2 over HTTP (``tritonclient.http``); ``None``: none.
        grpc_port: KServe v2 over gRPC (``tritonclient.grpc``); ``None``: none.
        max_connections: Connections served at once per replica on each port (a thread each
            while it has work; idle ones wait in a selector, without a thread).
        grpc_threads: gRPC requests served at once per replica.
        grpc_idle_timeout_s: How long a gRPC connection with no call open may stay quiet
            before it gets GOAWAY and is closed.
        grpc_max_header_bytes: Longest gRPC header block (headers and metadata) accepted.
        http_head_timeout_s: An HTTP request's line and headers must arrive within
            this, from their first byte, else 408 and close (60: nginx's
            ``client_header_timeout``).
        http_idle_timeout_s: A kept-alive HTTP connection with no request for this
            long is closed (60: nghttpx's ``--frontend-keep-alive-timeout``).
        http_body_grace_s: An HTTP body may take this long before
            ``http_body_min_rate`` applies, and go this long without a byte, else
            408 and close (20: Apache's ``RequestReadTimeout body=20``); only the
            time the server waits for the client counts.
        http_body_min_rate: Bytes a second an HTTP body must average after its
            grace time (500: Apache's ``RequestReadTimeout MinRate=500``).
        http_send_timeout_s: An HTTP answer not written within this (a client
            that does not read) ends its connection (60: nginx's
            ``send_timeout``, here for the whole answer).
        http_slot_stall_s: A leased slot waits no longer than this on an HTTP
            client: a tensor's bytes that do not all come within it (and as
            long again per 4 MiB; stalled or trickling) are copied out of the
            slot and read on in memory, an answer the client stops taking for
            as long is copied out and finished from memory; the slot goes back at once (1; no upstream
            equivalent: Triton reads a whole body before it uses its memory).
    """

    host: str = env_field("FRONTDOOR_HOST", "127.0.0.1")
    http_port: int | None = env_field("FRONTDOOR_HTTP_PORT", None, _optional_port)
    grpc_port: int | None = env_field("FRONTDOOR_GRPC_PORT", None, _optional_port)
    max_connections: int = env_field("FRONTDOOR_MAX_CONNECTIONS", 256)
    grpc_threads: int = env_field("FRONTDOOR_GRPC_THREADS", 16)
    grpc_idle_timeout_s: float = env_field("FRONTDOOR_GRPC_IDLE_TIMEOUT_S", IDLE_TIMEOUT_S)
    grpc_max_header_bytes: int = env_field("FRONTDOOR_GRPC_MAX_HEADER_BYTES", MAX_HEADER_BLOCK)
    http_head_timeout_s: float = env_field("FRONTDOOR_HTTP_HEAD_TIMEOUT_S", _HTTP_DEFAULTS.head_s)
    http_idle_timeout_s: float = env_field("FRONTDOOR_HTTP_IDLE_TIMEOUT_S", _HTTP_DEFAULTS.idle_s)
    http_body_grace_s: float = env_field("FRONTDOOR_HTTP_BODY_GRACE_S", _HTTP_DEFAULTS.body_grace_s)
    http_body_min_rate: float = env_field("FRONTDOOR_HTTP_BODY_MIN_RATE", _HTTP_DEFAULTS.body_min_rate)
    http_send_timeout_s: float = env_field("FRONTDOOR_HTTP_SEND_TIMEOUT_S", _HTTP_DEFAULTS.send_s)
    http_slot_stall_s: float = env_field("FRONTDOOR_HTTP_SLOT_STALL_S", SLOT_STALL_S)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"frontdoor.host must be an address such as 127.0.0.1, got {self.host!r}")
        for name in ("http_port", "grpc_port"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535
            ):
                raise ConfigError(f"frontdoor.{name} must be a port (0-65535) or null, got {value!r}")
        if self.http_port is None and self.grpc_port is None:
            raise ConfigError("frontdoor needs http_port, grpc_port or both")
        if self.http_port is not None and self.http_port == self.grpc_port and self.http_port != 0:
            raise ConfigError(f"frontdoor.http_port and grpc_port are both {self.http_port}")
        for name in ("max_connections", "grpc_threads", "grpc_max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"frontdoor.{name} must be an integer >= 1, got {value!r}")
        for name in (*_HTTP_SECONDS, "grpc_idle_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"frontdoor.{name} must be a number > 0, got {value!r}")

    @property
    def http_timeouts(self) -> HttpTimeouts:
        """The HTTP listener's time limits."""
        return HttpTimeouts(
            head_s=float(self.http_head_timeout_s),
            idle_s=float(self.http_idle_timeout_s),
            body_grace_s=float(self.http_body_grace_s),
            body_min_rate=float(self.http_body_min_rate),
            send_s=float(self.http_send_timeout_s),
        )

    @classmethod
    def from_args(cls, value: Mapping[str, Any] | None) -> FrontDoorConfig | None:
        """The config of an app's ``frontdoor`` arg (``None``: no front door).

        Raises:
            ConfigError: Not a mapping, an unknown key, or an invalid value.
        """
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(f"frontdoor must be a mapping (host, http_port, grpc_port), got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"frontdoor: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**dict(value))


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
    ) -> None:
        self._max_bytes = max_bytes
        self._client = client
        self._served_version = served_version
        self._delegate = delegate
        self._error_answer = error_answer
        self._stall_s = slot_stall_s

    def __call__(self, conn: Connection, head: RequestHead, body: Body) -> None:
        try:
            if not body.chunked and body.remaining > self._max_bytes:  # refused before it is read
                raise bounded.too_large("request body", self._max_bytes)
            if head.method == "POST":
                match = _INFER.match(head.path)
                if match and match.group(2) is None:
                    self._infer(conn, match.group(1), head, body)
                    return
            data = body.read_all(self._max_bytes)
            status, headers, payload = self._delegate(head, data)
            conn.respond(status, headers, [payload])
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

    def _infer(self, conn: Connection, model: str, head: RequestHead, body: Body) -> None:
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
                except InputError:
                    planned = None  # the general path raises the same error
            if planned is not None and planned[1]:
                decoded, spans = planned
                if shm_plan(client, model, decoded.inputs, decoded.outputs):
                    stalled = self._infer_in_slot(conn, model, prefix, decoded, spans, body)
                    if stalled is None:
                        return
                    data = stalled
            if not data:
                data += prefix
        body.read_rest_into(data, self._max_bytes)
        self._infer_general(conn, model, head, bytes(data))

    def _infer_general(self, conn: Connection, model: str, head: RequestHead, data: bytes) -> None:
        """Decode the whole body ``data``, run it with ``client.infer``, answer from memory."""
        client = self._client
        encoding = (head.headers.get("content-encoding") or "identity").strip().lower()
        if encoding != "identity":
            data = bounded.inflate(data, encoding, self._max_bytes)
        decoded = kserve.decode_request(
            data, kserve.parse_header_length(head.headers.get(kserve.HEADER_LENGTH))
        )
        version = self._served_version(model)
        outputs = client.infer(model, decoded.inputs, outputs=decoded.outputs, copy=False)
        host = {name: to_host(value) for name, value in outputs.items()}
        parts, headers = kserve.encode_response_parts(model, decoded, host, version)
        conn.respond(200, list(headers.items()), parts)

    def _slot_time(self, nbytes: int) -> float:
        """How long ``nbytes`` may take to come or go while they hold a slot: the stall time, and as
        long again per 4 MiB (as the gRPC door's messages)."""
        return self._stall_s * (1.0 + nbytes / SLOT_PACE_BYTES)

    def _infer_in_slot(
        self,
        conn: Connection,
        model: str,
        prefix: bytes,
        decoded: kserve.DecodedRequest,
        spans: list[kserve.BinarySpan],
        body: Body,
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

        Returns:
            ``None`` once answered; or, when the body stalled, the body read so
            far (``prefix`` and the tensor bytes that came), the slot given back.

        Raises:
            InputError: The body is longer than its tensors, or as ``client.run``.
            HttpTimeoutError: The body came too slowly.
            ConnectionGone: The client went, or did not take the answer in time.
        """
        client = self._client
        version = self._served_version(model)
        with client.lease(model) as lease:
            for name, array in decoded.inputs.items():  # JSON inputs of the same request
                if all(span.name != name for span in spans):
                    lease.input(name, array.shape)[...] = array
            filled: list[memoryview] = []
            for span in spans:
                target = lease.input(span.name, decoded.inputs[span.name].shape)
                view = memoryview(target.reshape(-1).view(np.uint8))
                del target
                got = body.readinto(view, self._slot_time(len(view)))
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
            outputs = run_leased(client, model, lease, decoded.outputs)
            parts, headers = kserve.encode_response_parts(model, decoded, dict(outputs), version)
            del outputs
            # Written from the slot while the client takes it; what it does not take in
            # time is copied out (rest), sent once the slot is back.
            rest = conn.respond(200, list(headers.items()), parts, self._stall_s)
            # No view of the slot outlives the lease: it goes straight back, not pinned.
            del parts
        conn.send_rest(rest)
        return None


class FrontDoor:
    """A replica's front door: its HTTP and gRPC listeners and the event loop they delegate to.

    Args:
        config: Where to listen.
        deployment: The :class:`~ray_triton_shm.serve.TritonDeployment` instance
            (its client, its ``__call__`` for other HTTP routes, its gRPC methods).
        app_name: The Serve app's name (the gRPC ``application`` metadata must match it).

    Raises:
        FrontDoorError: A port cannot be bound, or another app on this node has it
            (nothing is left listening then).
    """

    def __init__(self, config: FrontDoorConfig, deployment: Any, app_name: str) -> None:
        self.config = config
        self._deployment = deployment
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="frontdoor-loop", daemon=True)
        self._thread.start()
        self._run = run_on(self._loop)
        self.http: HttpListener | None = None
        self.grpc: Any = None
        self._claims: list[PortClaim] = []
        try:
            # A fixed port is claimed before it is bound (another app's claim: refused, nothing
            # bound); a port the OS picks is new, and is claimed once known.
            for port in (config.http_port, config.grpc_port):
                if port:
                    self._claims.append(PortClaim(port, app_name))
            if config.http_port is not None:
                handler = KServeHttpHandler(
                    deployment._client,
                    self.served_version,
                    self._delegate_http,
                    _error_answer,
                    deployment._max_request_bytes,
                    slot_stall_s=config.http_slot_stall_s,
                )
                self.http = HttpListener(
                    config.host,
                    config.http_port,
                    handler,
                    max_connections=config.max_connections,
                    timeouts=config.http_timeouts,
                )
                if not config.http_port:
                    self._claims.append(PortClaim(self.http.port, app_name))
            if config.grpc_port is not None:
                self.grpc = GrpcDoor(
                    config.host,
                    config.grpc_port,
                    client=deployment._client,
                    servicer=_Servicer(deployment),
                    served_version=self.served_version,
                    run=self._run,
                    app_name=app_name,
                    threads=config.grpc_threads,
                    limits=H2Limits(
                        max_message=deployment._max_request_bytes,
                        max_header_block=config.grpc_max_header_bytes,
                        idle_timeout_s=config.grpc_idle_timeout_s,
                    ),
                    max_connections=config.max_connections,
                )
                if not config.grpc_port:
                    self._claims.append(PortClaim(self.grpc.port, app_name))
        except BaseException:
            self.close()
            raise

    def served_version(self, model: str) -> str:
        """The deployment's cached answer, or its lookup run on the front door's loop."""
        cached = self._deployment._versions.get(model, time.monotonic())
        if cached is not None:
            return cached
        return self._run(self._deployment._served_version(model))

    def _delegate_http(self, head: RequestHead, data: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """``head`` and its body answered by the Serve ingress's own handler (``deployment.__call__``)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": head.version[5:],
            "method": head.method,
            "scheme": "http",
            "path": head.path,
            "raw_path": head.path.encode(),
            "root_path": "",
            "query_string": head.query.encode("latin-1"),
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head.headers.items()],
        }
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        response = self._run(self._deployment(Request(scope, receive)))
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-length"]
        return response.status_code, headers, bytes(response.body)

    def close(self) -> None:
        """Stop both listeners and the loop; returns when nothing listens any more."""
        if self.http is not None:
            self.http.close()
        if self.grpc is not None:
            self.grpc.close()
        for claim in self._claims:  # once the ports are no longer bound
            claim.close()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            with contextlib.suppress(RuntimeError):
                self._loop.close()


class _Servicer:
    """The deployment's gRPC methods, with gRPC channels of the front door's own event loop.

    The ingress keeps its channels to Triton per event loop (in ``_channels``):
    this object has its own and takes everything else from the deployment.
    """

    def __init__(self, deployment: Any) -> None:
        self._deployment = deployment
        self._channels: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(type(self._deployment), name, None)
        if callable(value) and not name.startswith("__"):
            return value.__get__(self)  # the method, bound to this object
        return getattr(self._deployment, name)


def _error_answer(error: Exception) -> tuple[int, bytes]:
    """The KServe error answer of ``error`` (as the Serve ingress answers it)."""
    return kserve_errors.error_answer(error)
