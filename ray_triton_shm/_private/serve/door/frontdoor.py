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
On shutdown the door drains (:meth:`FrontDoor.drain`). Its settings, given in the app's
``frontdoor`` arg, are a
:class:`~ray_triton_shm._private.serve.door.frontdoor_config.FrontDoorConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from starlette.requests import Request

from ray_triton_shm._private.node.port_claim import PortClaim
from ray_triton_shm._private.serve.door.calls import CallGate, Observer
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.door.frontdoor_grpc import GrpcDoor, run_on
from ray_triton_shm._private.serve.door.frontdoor_http import KServeHttpHandler, error_answer
from ray_triton_shm._private.serve.http1.head import RequestHead
from ray_triton_shm._private.serve.http1.server import HttpListener
from ray_triton_shm._private.serve.net.malloc_thresholds import set_malloc_thresholds
from ray_triton_shm.errors import FrontDoorError

logger = logging.getLogger(__name__)

CLOSE_S = 1.0
"""How long the door's close gives the calls on the connections it shuts (a drain that ran out included)."""


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
        set_malloc_thresholds(config.malloc_mmap_threshold_bytes)  # the replica's large buffers go back
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
                    engine=config.grpc_engine,
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
