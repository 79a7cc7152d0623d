"""The front door's settings: where a replica's own listeners listen, and what their clients may cost.

:class:`FrontDoorConfig` holds them (each explicit, else from its
``RAY_TRITON_SHM_FRONTDOOR_*`` variable, else its default), checks them, and gives
the gRPC listener its :class:`~ray_triton_shm._private.serve.http2.h2_wire.H2Limits`
and the HTTP listener its :class:`~ray_triton_shm._private.serve.http1.timing.HttpTimeouts`.
The door itself is :class:`~ray_triton_shm._private.serve.door.frontdoor.FrontDoor`.

Configured in the app's args::

    args:
      frontdoor: {host: 127.0.0.1, http_port: 8080, grpc_port: 8081}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ray_triton_shm._private.serve.door.frontdoor_http import MAX_JSON_BYTES, MAX_UNSENT_BYTES, SLOT_STALL_S
from ray_triton_shm._private.serve.http1.timing import HttpTimeouts
from ray_triton_shm._private.serve.http2 import h2_wire
from ray_triton_shm._private.serve.http2.engine import ENGINES as GRPC_ENGINES
from ray_triton_shm._private.serve.http2.h2_wire import H2Limits
from ray_triton_shm._private.serve.net.listener import MAX_OPEN
from ray_triton_shm._private.serve.net.malloc_thresholds import MAX_MMAP_THRESHOLD
from ray_triton_shm._private.serve.protocol.slot_plan import BUSY_STALL_S
from ray_triton_shm.config import env_field
from ray_triton_shm.errors import ConfigError


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
        grpc_engine: What serves a gRPC connection: ``"auto"`` (nghttp2 where it was built,
            else python), ``"python"`` (this package's HTTP/2 code) or ``"nghttp2"`` (nghttp2
            in C, built with the package where ``libnghttp2``'s headers were installed; a
            listener asked for it where it was not built refuses to start). Both keep the
            same limits and answer the same way; nghttp2 takes less CPU per call.
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
        grpc_max_spare_bytes: Bytes of message buffers the gRPC listener keeps, once their
            messages are done, for the next ones read into memory (32 MiB; 0: none kept): a
            kept buffer's pages are mapped already, where a new one's cost a page fault each.
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
            decodes at once (64 MiB, as ``max_request_bytes``): decoded, a flat array of
            numbers takes 8 bytes a number (the C reader), anything else up to about 3x its
            text in Python objects, so many large JSON bodies at once would take the
            replica's memory. A body past the room waits for its turn (not counted against
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
        malloc_mmap_threshold_bytes: glibc's ``mmap_threshold`` in the replica's process, set
            when its door opens, and its trim threshold at twice that (1 MiB; 0: glibc's own,
            which rises to each large block freed, up to 32 MiB). Fixed, a buffer past it
            (a large JSON body, a buffered gRPC message) goes back to the system when freed
            rather than staying in the heap of the thread that freed it.
    """

    host: str = env_field("FRONTDOOR_HOST", "127.0.0.1")
    http_port: int | None = env_field("FRONTDOOR_HTTP_PORT", None, _optional_port)
    grpc_port: int | None = env_field("FRONTDOOR_GRPC_PORT", None, _optional_port)
    max_connections: int = env_field("FRONTDOOR_MAX_CONNECTIONS", 256)
    max_open_connections: int = env_field("FRONTDOOR_MAX_OPEN_CONNECTIONS", MAX_OPEN)
    grpc_threads: int = env_field("FRONTDOOR_GRPC_THREADS", 16)
    grpc_engine: str = env_field("FRONTDOOR_GRPC_ENGINE", "auto")
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
    grpc_max_spare_bytes: int = env_field("FRONTDOOR_GRPC_MAX_SPARE_BYTES", h2_wire.MAX_SPARE_BYTES)
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
    malloc_mmap_threshold_bytes: int = env_field("FRONTDOOR_MALLOC_MMAP_THRESHOLD_BYTES", 1024 * 1024)

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
        if self.grpc_engine not in GRPC_ENGINES:
            raise ConfigError(
                f"frontdoor.grpc_engine must be one of {', '.join(GRPC_ENGINES)}, got {self.grpc_engine!r}"
            )
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
        spare = self.grpc_max_spare_bytes
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ConfigError(f"frontdoor.grpc_max_spare_bytes must be an integer >= 0, got {spare!r}")
        threshold = self.malloc_mmap_threshold_bytes
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int)
            or not 0 <= threshold <= MAX_MMAP_THRESHOLD
        ):
            raise ConfigError(
                f"frontdoor.malloc_mmap_threshold_bytes must be an integer in 0..{MAX_MMAP_THRESHOLD}, "
                f"got {threshold!r}"
            )
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
            max_spare_bytes=self.grpc_max_spare_bytes,
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
