"""The front door: each replica's own KServe v2 listeners (HTTP and gRPC) on the app's stable ports.

Clients outside Ray (``tritonclient.http``, ``tritonclient.grpc``) reach the
replica without Serve's proxy in between. Every replica of the app on a node
listens on the same ports, and any node's address works on a multi-node cluster (bind
``0.0.0.0`` there). A replica of another app given the same port refuses to
start (:mod:`~ray_triton_shm._private.node.port_claim`), and the app's
replicas on a node accept from one listening socket, handed from replica to
replica. The listeners run in the replica's process, in threads of their own
(a thread per connection while it has work, idle ones parked in a selector;
gRPC calls run on a thread pool), and close with the replica.

HTTP: see :mod:`~ray_triton_shm._private.serve.door.frontdoor_http`; gRPC: see
:mod:`~ray_triton_shm._private.serve.door.frontdoor_grpc`. The door's calls are
counted (:class:`~ray_triton_shm._private.serve.door.calls.CallGate`): Serve's
autoscaler sees them as the replica's ongoing requests, and past the
deployment's ``max_ongoing_requests`` a call is refused ``UNAVAILABLE`` (503).
On shutdown the door drains (:meth:`FrontDoor.drain`).

Configured in the app's args::

    args:
      frontdoor: {host: 127.0.0.1, http_port: 8080, grpc_port: 8081}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from starlette.requests import Request

from ray_triton_shm._private.node.port_claim import PortClaim
from ray_triton_shm._private.serve.door.calls import CallGate, Observer
from ray_triton_shm._private.serve.door.frontdoor_grpc import GrpcDoor, run_on
from ray_triton_shm._private.serve.door.frontdoor_http import (
    MAX_JSON_BYTES,
    MAX_UNSENT_BYTES,
    SLOT_STALL_S,
    KServeHttpHandler,
    error_answer,
)
from ray_triton_shm._private.serve.http1.head import RequestHead
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.http1.timing import HttpTimeouts
from ray_triton_shm._private.serve.http2 import h2_wire
from ray_triton_shm._private.serve.http2.h2_wire import H2Limits
from ray_triton_shm._private.serve.net.listener import MAX_OPEN
from ray_triton_shm._private.serve.protocol.slot_plan import BUSY_STALL_S
from ray_triton_shm.config import env_field
from ray_triton_shm.errors import ConfigError, FrontDoorError

logger = logging.getLogger(__name__)

CLOSE_S = 1.0
"""How long the door's close gives the calls on the connections it shuts (a drain that ran out included)."""


def _optional_port(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none", "off") else int(text)


_HTTP_DEFAULTS = HttpTimeouts()
_COUNTS = (
    "max_connections",
    "max_open_connections",
    "grpc_threads",
    "grpc_max_header_bytes",
    "grpc_max_streams",
    "grpc_max_connection_bytes",
    "grpc_max_buffered_bytes",
    "grpc_glitch_burst",
    "grpc_max_unsent_bytes",
    "http_max_unsent_bytes",
    "http_max_json_bytes",
    "http_max_buffered_bytes",
)
_GRPC_NUMBERS = (
    "grpc_idle_timeout_s",
    "grpc_preface_timeout_s",
    "grpc_slot_stall_s",
    "grpc_send_timeout_s",
    "grpc_glitch_rate",
)
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
        max_open_connections: Connections open at once per replica on each port, idle ones
            included; past it a new connection is accepted and closed at once (logged).
        grpc_threads: gRPC requests served at once per replica; as many again for calls
            whose message is already in a slot (run apart, so they never wait behind calls
            that wait for a slot).
        grpc_idle_timeout_s: How long a gRPC connection with no call open may stay quiet
            before it gets GOAWAY and is closed.
        grpc_max_header_bytes: Longest gRPC header block (headers and metadata) accepted.
        grpc_preface_timeout_s: Time a new gRPC connection has for HTTP/2's preface and its
            first SETTINGS.
        grpc_slot_stall_s: A leased slot waits no longer than this on a gRPC client: a message
            whose bytes do not all come within it (and as long again per 4 MiB) is read on
            in memory, an answer the client opens no window for as long is copied out; the
            slot goes back at once (as ``http_slot_stall_s``).
        grpc_send_timeout_s: A gRPC answer the client does not take within this (no window
            opened, nothing read) ends its connection.
        grpc_max_streams: Streams a gRPC connection may have open at once (announced as
            ``SETTINGS_MAX_CONCURRENT_STREAMS``; one past it is refused, ``REFUSED_STREAM``).
        grpc_max_connection_bytes: Request bytes one gRPC connection's messages may hold in
            memory at once (past it: ``RESOURCE_EXHAUSTED``).
        grpc_max_buffered_bytes: Request bytes all gRPC connections of a replica may hold in
            memory at once (past it: ``RESOURCE_EXHAUSTED``).
        grpc_glitch_burst: Frames that carry no call (PING, SETTINGS, RST_STREAM, empty DATA,
            ...) a gRPC connection may send at once; past the burst and
            ``grpc_glitch_rate`` a second, GOAWAY ``ENHANCE_YOUR_CALM`` (nghttp2's limits).
        grpc_glitch_rate: Such frames a second after the burst.
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
            as long is copied out and finished from memory; the slot goes back
            at once (1; no upstream equivalent: Triton reads a whole body
            before it uses its memory).
        http_max_unsent_bytes: Bytes of HTTP answers the replica holds at once for
            clients that took none of them for ``http_slot_stall_s`` (copied out of
            their slots, or answers from memory); an answer with no room left ends
            its connection (128 MiB; no upstream equivalent: Triton holds every
            such answer).
        grpc_max_unsent_bytes: The same for gRPC answers (``grpc_slot_stall_s``),
            128 MiB.
        http_max_buffered_bytes: Bytes of HTTP request bodies all of a replica's connections
            may hold in memory at once (1 GiB, as ``grpc_max_buffered_bytes``); a body read into
            memory takes from it as it grows, and one that does not fit is answered 503 (try
            again). A binary tensor while it is read into a slot does not count.
        http_max_json_bytes: Bytes of HTTP request JSON (tensors as JSON arrays) the replica
            decodes at once (64 MiB, as ``max_request_bytes``): their Python objects take
            about 3x the text, so many large JSON bodies at once would take the replica's
            memory. A body past the room waits for its turn (not counted against
            ``max_ongoing_requests`` meanwhile); turns go in order of arrival, and one larger
            than the room decodes alone.
        slot_busy_stall_s: ``http_slot_stall_s`` and ``grpc_slot_stall_s`` while other
            calls of the replica wait for a slot of the same pool (0.1): many slow
            clients, more than the slots, then cannot keep the slots a second each
            while prompt callers queue behind them.
        drain_timeout_s: When the replica stops (downscale, redeploy, ``serve
            shutdown``), how long its calls in flight may take to finish after it
            stops accepting (HTTP/2 clients get GOAWAY, HTTP/1.1 answers
            ``Connection: close``); keep it under the deployment's
            ``graceful_shutdown_timeout_s`` (Serve's default: 20): in a Serve
            replica the drain takes no more than what that leaves after Serve's
            wait loop, the app's status and the close.
        port_linger_s: How long the node keeps a fixed port open with no replica of the
            app on it (a redeploy that stops the old replicas before the new ones
            start): connections wait in the port's queue for the next replica. The
            port closes at once when the app is deleted; 0: with the last replica.
    """

    host: str = env_field("FRONTDOOR_HOST", "127.0.0.1")
    http_port: int | None = env_field("FRONTDOOR_HTTP_PORT", None, _optional_port)
    grpc_port: int | None = env_field("FRONTDOOR_GRPC_PORT", None, _optional_port)
    max_connections: int = env_field("FRONTDOOR_MAX_CONNECTIONS", 256)
    max_open_connections: int = env_field("FRONTDOOR_MAX_OPEN_CONNECTIONS", MAX_OPEN)
    grpc_threads: int = env_field("FRONTDOOR_GRPC_THREADS", 16)
    grpc_idle_timeout_s: float = env_field("FRONTDOOR_GRPC_IDLE_TIMEOUT_S", h2_wire.IDLE_TIMEOUT_S)
    grpc_max_header_bytes: int = env_field("FRONTDOOR_GRPC_MAX_HEADER_BYTES", h2_wire.MAX_HEADER_BLOCK)
    grpc_preface_timeout_s: float = env_field("FRONTDOOR_GRPC_PREFACE_TIMEOUT_S", h2_wire.PREFACE_TIMEOUT_S)
    grpc_slot_stall_s: float = env_field("FRONTDOOR_GRPC_SLOT_STALL_S", h2_wire.SLOT_STALL_S)
    grpc_send_timeout_s: float = env_field("FRONTDOOR_GRPC_SEND_TIMEOUT_S", h2_wire.SEND_TIMEOUT_S)
    grpc_max_streams: int = env_field("FRONTDOOR_GRPC_MAX_STREAMS", h2_wire.MAX_STREAMS)
    grpc_max_connection_bytes: int = env_field(
        "FRONTDOOR_GRPC_MAX_CONNECTION_BYTES", h2_wire.MAX_CONNECTION_BYTES
    )
    grpc_max_buffered_bytes: int = env_field("FRONTDOOR_GRPC_MAX_BUFFERED_BYTES", h2_wire.MAX_BUFFERED_BYTES)
    grpc_glitch_burst: int = env_field("FRONTDOOR_GRPC_GLITCH_BURST", h2_wire.GLITCH_BURST)
    grpc_glitch_rate: float = env_field("FRONTDOOR_GRPC_GLITCH_RATE", h2_wire.GLITCH_RATE)
    grpc_max_unsent_bytes: int = env_field("FRONTDOOR_GRPC_MAX_UNSENT_BYTES", h2_wire.MAX_UNSENT_BYTES)
    http_head_timeout_s: float = env_field("FRONTDOOR_HTTP_HEAD_TIMEOUT_S", _HTTP_DEFAULTS.head_s)
    http_idle_timeout_s: float = env_field("FRONTDOOR_HTTP_IDLE_TIMEOUT_S", _HTTP_DEFAULTS.idle_s)
    http_body_grace_s: float = env_field("FRONTDOOR_HTTP_BODY_GRACE_S", _HTTP_DEFAULTS.body_grace_s)
    http_body_min_rate: float = env_field("FRONTDOOR_HTTP_BODY_MIN_RATE", _HTTP_DEFAULTS.body_min_rate)
    http_send_timeout_s: float = env_field("FRONTDOOR_HTTP_SEND_TIMEOUT_S", _HTTP_DEFAULTS.send_s)
    http_slot_stall_s: float = env_field("FRONTDOOR_HTTP_SLOT_STALL_S", SLOT_STALL_S)
    http_max_unsent_bytes: int = env_field("FRONTDOOR_HTTP_MAX_UNSENT_BYTES", MAX_UNSENT_BYTES)
    http_max_json_bytes: int = env_field("FRONTDOOR_HTTP_MAX_JSON_BYTES", MAX_JSON_BYTES)
    http_max_buffered_bytes: int = env_field("FRONTDOOR_HTTP_MAX_BUFFERED_BYTES", h2_wire.MAX_BUFFERED_BYTES)
    slot_busy_stall_s: float = env_field("FRONTDOOR_SLOT_BUSY_STALL_S", BUSY_STALL_S)
    drain_timeout_s: float = env_field("FRONTDOOR_DRAIN_TIMEOUT_S", 10.0)
    port_linger_s: float = env_field("FRONTDOOR_PORT_LINGER_S", 30.0)

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
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"frontdoor.{name} must be an integer >= 1, got {value!r}")
        for name in (*_HTTP_SECONDS, *_GRPC_NUMBERS, "slot_busy_stall_s", "drain_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"frontdoor.{name} must be a number > 0, got {value!r}")
        linger = self.port_linger_s
        if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 <= linger < math.inf:
            raise ConfigError(f"frontdoor.port_linger_s must be a number >= 0, got {linger!r}")

    def h2_limits(self, max_message: int) -> H2Limits:
        """The gRPC listener's limits, with messages of at most ``max_message`` bytes."""
        return H2Limits(
            max_message=max_message,
            max_header_block=self.grpc_max_header_bytes,
            idle_timeout_s=float(self.grpc_idle_timeout_s),
            preface_timeout_s=float(self.grpc_preface_timeout_s),
            glitch_burst=self.grpc_glitch_burst,
            glitch_rate=float(self.grpc_glitch_rate),
            slot_stall_s=float(self.grpc_slot_stall_s),
            slot_busy_stall_s=float(self.slot_busy_stall_s),
            max_connection_bytes=self.grpc_max_connection_bytes,
            max_buffered_bytes=self.grpc_max_buffered_bytes,
            max_streams=self.grpc_max_streams,
            send_timeout_s=float(self.grpc_send_timeout_s),
            max_unsent_bytes=self.grpc_max_unsent_bytes,
        )

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


class FrontDoor:
    """A replica's front door: its HTTP and gRPC listeners and the event loop they delegate to.

    Args:
        config: Where to listen.
        deployment: The :class:`~ray_triton_shm.serve.TritonDeployment` instance
            (its client, its ``__call__`` for other HTTP routes, its gRPC methods).
        app_name: The Serve app's name (the gRPC ``application`` metadata must match it).
        max_ongoing: Calls the door runs at once (the deployment's
            ``max_ongoing_requests``); more are refused ``UNAVAILABLE`` (503). ``None``: no bound.
        observer: Called with each call's record once it ends (metrics, access log).

    Raises:
        FrontDoorError: A port cannot be bound, or another app on this node has it
            (nothing is left listening then).
    """

    def __init__(
        self,
        config: FrontDoorConfig,
        deployment: Any,
        app_name: str,
        *,
        max_ongoing: int | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = config
        self.calls = CallGate(max_ongoing, observer)
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
            # bound), and its listening socket is the one the app's replicas on this node share;
            # a port the OS picks is new, this replica's own, and is claimed once known.
            listening = {}
            for protocol, port in (("HTTP", config.http_port), ("gRPC", config.grpc_port)):
                if port:
                    claim = PortClaim(port, app_name)
                    self._claims.append(claim)
                    listening[protocol] = claim.listening_socket(config.host, protocol)
            if config.http_port is not None:
                handler = KServeHttpHandler(
                    deployment._client,
                    self.served_version,
                    self._delegate_http,
                    error_answer,
                    deployment._max_request_bytes,
                    slot_stall_s=config.http_slot_stall_s,
                    gate=self.calls,
                    max_unsent_bytes=config.http_max_unsent_bytes,
                    busy_stall_s=config.slot_busy_stall_s,
                    max_json_bytes=config.http_max_json_bytes,
                )
                self.http = HttpListener(
                    config.host,
                    config.http_port,
                    handler,
                    max_connections=config.max_connections,
                    max_open=config.max_open_connections,
                    timeouts=config.http_timeouts,
                    max_buffered_bytes=config.http_max_buffered_bytes,
                    listening=listening.pop("HTTP", None),
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
                    limits=config.h2_limits(deployment._max_request_bytes),
                    max_connections=config.max_connections,
                    max_open=config.max_open_connections,
                    gate=self.calls,
                    listening=listening.pop("gRPC", None),
                )
                if not config.grpc_port:
                    self._claims.append(PortClaim(self.grpc.port, app_name))
        except BaseException:
            for sock in listening.values():
                sock.close()
            self.close()
            raise

    def _listeners(self) -> list[Any]:
        return [listener for listener in (self.http, self.grpc) if listener is not None]

    def check(self) -> None:
        """Raise unless the door can serve: each listener accepting, its loop running.

        Raises:
            FrontDoorError: A listener stopped accepting, or the door's event loop is gone.
        """
        if not self._thread.is_alive():
            raise FrontDoorError("the front door's event loop has stopped")
        for listener in self._listeners():
            if not listener.accepting:
                raise FrontDoorError(f"the front door no longer accepts connections on port {listener.port}")

    def stats(self) -> dict[str, Any]:
        """The door's ports, open connections and calls (running, waiting for a slot, taken, refused for
        the bound, the bound)."""
        return {
            "http_port": self.http.port if self.http is not None else None,
            "grpc_port": self.grpc.port if self.grpc is not None else None,
            "connections": sum(len(listener.open_connections()) for listener in self._listeners()),
            "ongoing": self.calls.ongoing,
            "waiting": self.calls.waiting,
            "calls": self.calls.total,
            "refused": self.calls.refused,
            "max_ongoing": self.calls.limit,
        }

    def drain(self, wait_s: float) -> bool:
        """Stop taking connections, let the calls in flight finish (at most ``wait_s``), then close.

        New connections go to the app's other replicas on this node (the port
        stays open while one holds it). HTTP/2 clients get GOAWAY; HTTP/1.1
        answers carry ``Connection: close``; a connection idle meanwhile is closed.

        Returns:
            Whether every connection ended within ``wait_s`` (else the rest were shut).
        """
        for claim in self._claims:  # the app's next replicas borrow the socket from another
            claim.close()
        results: list[bool] = []
        threads = [
            threading.Thread(target=lambda listener=listener: results.append(listener.drain(wait_s)))
            for listener in self._listeners()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.close()
        return all(results)

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

    def close(self, wait_s: float = CLOSE_S) -> None:
        """Stop both listeners and the loop; returns when nothing listens any more.

        Open connections are shut; their calls get ``wait_s`` in all to end, and
        one still running then is left to end with no connection to answer on.
        """
        deadline = time.monotonic() + wait_s
        if self.http is not None:
            self.http.close(wait_s)
        if self.grpc is not None:
            self.grpc.close(max(0.0, deadline - time.monotonic()))
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
