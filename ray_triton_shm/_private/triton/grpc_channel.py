"""A ``tritonclient.grpc`` client that works at once when its server comes back.

A gRPC channel that tried to connect while its server was down stays in
TRANSIENT_FAILURE and reconnects with exponential backoff (1 s, 1.6 s, 2.6 s,
... up to 120 s). Meanwhile every call fails at once with ``UNAVAILABLE:
failed to connect to all addresses``, even once the server is back and
ready: after a server down for 30 s, calls kept failing for 15 s after its
restart. By default gRPC also shares subchannels between channels of the same
target and arguments (the global subchannel pool), so a new channel made to
get away from the backoff inherits it, and so does every other client of that
server in the process.

:class:`TritonGrpc` gives each channel its own subchannels, and when a call
fails that way (the call was never sent: it failed while picking a
connection) and the server accepts a TCP connection now, it replaces the
channel with a fresh one and makes the call once more.

Example:
    >>> grpc = TritonGrpc("127.0.0.1:8001")                     # doctest: +SKIP
    >>> grpc.get_model_config("identity", as_json=True)        # doctest: +SKIP
    >>> grpc.close()                                            # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm.errors import PoolClosedError

logger = logging.getLogger(__name__)

# What a call gets when the channel fails it while picking a connection (pick_first in
# TRANSIENT_FAILURE): it never left the client. A call cut off by the server going away
# gets another message ("Stream removed (Socket closed)", "Connection reset by peer").
NEVER_SENT_PREFIX = "failed to connect to all addresses"
_CLOSED_CHANNEL = "closed channel"
_PROBE_TIMEOUT_S = 1.0


def channel_options() -> list[tuple[str, Any]]:
    """tritonclient's own channel options, plus subchannels of the channel's own.

    ``grpc.use_local_subchannel_pool``: a channel's connection state (and its
    reconnect backoff) is not shared with other channels to the same server.
    """
    keepalive = grpcclient.KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.use_local_subchannel_pool", 1),
    ]


def new_grpc_client(url: str) -> grpcclient.InferenceServerClient:
    """A ``tritonclient.grpc`` client of ``url`` with :func:`channel_options`."""
    return grpcclient.InferenceServerClient(url=url, channel_args=channel_options())


def never_sent(error: InferenceServerException) -> bool:
    """Whether ``error`` is a call the channel failed before sending it (no connection to pick)."""
    status = str(error.status() or "").rsplit(".", 1)[-1]
    return status == "UNAVAILABLE" and str(error.message() or "").startswith(NEVER_SENT_PREFIX)


def split_host_port(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``[v6 address]:port`` url; None if it has no port."""
    host, sep, port = url.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def accepts_connections(url: str, timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``url`` now (a fresh connection, closed at once)."""
    address = split_host_port(url)
    if address is None:
        return False
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


class TritonGrpc:
    """``tritonclient.grpc.InferenceServerClient``'s methods, on a channel replaced when it is stale.

    Every public method of ``InferenceServerClient`` is available here with
    the same arguments, answers and errors. A call that the channel failed
    without sending it while the server accepts connections (the channel is
    still backing off from a time the server was down) is made once more on a
    new channel; any other error is the caller's.

    Args:
        url: ``host:port`` of Triton's gRPC endpoint.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._client = new_grpc_client(url)
        self._closed = False
        self.replaced = 0  # channels replaced so far (for tests and logs)

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        """The ``InferenceServerClient`` calls go to now."""
        return self._client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not callable(getattr(grpcclient.InferenceServerClient, name, None)):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return functools.partial(self.call, name)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``InferenceServerClient.<method>(*args, **kwargs)``, once more on a fresh channel if stale.

        Raises:
            InferenceServerException: As the method raises it (of the second try, if made).
            PoolClosedError: The client is closed (before the call, or under it by another thread).
        """
        client = self._client
        try:
            return getattr(client, method)(*args, **kwargs)
        except InferenceServerException as e:
            if not never_sent(e) or not self._replace(client):
                raise
        except ValueError as e:
            if _CLOSED_CHANNEL not in str(e):
                raise
            if self._closed:  # its owner closed it (a reconnect replaced it, or a shutdown)
                raise PoolClosedError(f"the gRPC client of {self.url} is closed") from e
            # Another thread replaced (and closed) the channel between our read of it and the call.
            if client is self._client:
                raise
        return getattr(self._client, method)(*args, **kwargs)

    def _replace(self, stale: grpcclient.InferenceServerClient) -> bool:
        """Put a new channel in place of ``stale`` if the server is back; whether a retry may go."""
        with self._lock:
            if self._closed:
                return False
            if self._client is not stale:  # another thread replaced it already
                return True
            if not accepts_connections(self.url):  # the server is still down: the error stands
                return False
            self._client = new_grpc_client(self.url)
            self.replaced += 1
        logger.info("gRPC channel to %s was backing off from a server that is back; replaced it", self.url)
        stale.close()
        return True

    def close(self) -> None:
        """Close the channel; calls after this raise :class:`PoolClosedError`. Idempotent."""
        with self._lock:
            self._closed = True
            client = self._client
        client.close()


GrpcClient = grpcclient.InferenceServerClient | TritonGrpc
"""Either kind: what code that only calls ``InferenceServerClient``'s methods accepts."""


_IN_USE = "in use"


def unregister_region(grpc: GrpcClient, name: str, cuda: bool, wait_s: float, **kwargs: Any) -> None:
    """Unregister shared-memory region ``name`` from Triton, waiting up to ``wait_s`` while it is in use.

    Triton refuses to unregister a region a request still uses ("it is currently in
    use"), and lets go of a request's region only just after its answer is sent: an
    unregister right after the last answer may be refused, and would leave the region
    mapped in Triton.

    Args:
        grpc: The client.
        name: The region.
        cuda: A CUDA region (else a system one).
        wait_s: How long to try again while Triton says the region is in use.
        **kwargs: For the unregister call (``headers``, ``client_timeout``).

    Raises:
        InferenceServerException: Triton's answer, when it is not "in use", or still is after ``wait_s``.
    """
    unregister = grpc.unregister_cuda_shared_memory if cuda else grpc.unregister_system_shared_memory
    deadline = time.monotonic() + wait_s
    while True:
        try:
            unregister(name, **kwargs)
            return
        except InferenceServerException as e:
            if _IN_USE not in str(e.message()) or time.monotonic() >= deadline:
                raise
        time.sleep(0.05)
