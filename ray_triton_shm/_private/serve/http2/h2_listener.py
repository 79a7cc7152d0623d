"""A gRPC server's listener: connections accepted, each served by one of two engines.

:class:`H2Listener` accepts on its port (idle connections wait in a selector, a busy one has
a thread: :class:`~ray_triton_shm._private.serve.net.listener.TcpListener`) and gives each
connection to its engine: :class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection`
(the package's HTTP/2 in Python) or
:class:`~ray_triton_shm._private.serve.http2.engine.EngineConnection` (nghttp2 in C). Calls run
on the listener's two worker pools (calls whose message is already in a slot on the second).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray_triton_shm._private.serve.http2.engine import ENGINES, EngineConnection, resolved
from ray_triton_shm._private.serve.http2.engine import available as engine_available
from ray_triton_shm._private.serve.http2.grpc_h2 import H2Connection
from ray_triton_shm._private.serve.http2.grpc_message import Placer
from ray_triton_shm._private.serve.http2.h2_receive import Refuse
from ray_triton_shm._private.serve.http2.h2_stream import Call
from ray_triton_shm._private.serve.http2.h2_wire import H2Limits
from ray_triton_shm._private.serve.net.bounded import ByteBudget, SpareBuffers
from ray_triton_shm._private.serve.net.listener import MAX_OPEN, TcpListener
from ray_triton_shm.errors import ConfigError

DEFAULT_ENGINE = "auto"  # what serves a connection when the listener is not told (see ENGINES)


class H2Listener(TcpListener):
    """A gRPC server on ``host:port``: a thread per busy connection, calls on a pool.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        handler: Runs each call (a :class:`Call`), in one of ``threads`` worker threads.
        refuse: See :class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection`.
        place: See :class:`~ray_triton_shm._private.serve.http2.grpc_h2.H2Connection`.
        fast: Runs placed calls without a worker thread where the engine can (see
            :class:`~ray_triton_shm._private.serve.http2.engine.EngineConnection`).
        engine: What serves each connection: ``"python"`` (:class:`H2Connection`),
            ``"nghttp2"`` (:class:`~ray_triton_shm._private.serve.http2.engine.EngineConnection`)
            or ``"auto"`` (nghttp2 where it was built, else python; :attr:`engine` says which);
            ``None``: :data:`DEFAULT_ENGINE`.
        threads: Calls run at once; as many again for calls whose message is already in a
            slot (they run apart, never waiting behind calls that wait for a slot).
        limits: What each connection may cost (see :class:`H2Limits`).
        max_connections: Connections served at once; more wait in the backlog.
        max_open: Connections open at once, idle ones included.
        listening: A listening socket to accept from instead of binding one.

    Raises:
        FrontDoorError: The address cannot be bound.
        ConfigError: An engine this listener does not know, or one not built here.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[Call], None],
        *,
        refuse: Refuse | None = None,
        place: Callable[[str], Placer | None] | None = None,
        fast: Any = None,
        engine: str | None = None,
        threads: int = 16,
        limits: H2Limits | None = None,
        max_connections: int = 256,
        listening: socket.socket | None = None,
        max_open: int = MAX_OPEN,
    ) -> None:
        limits = limits or H2Limits()
        engine = engine or DEFAULT_ENGINE
        if engine not in ENGINES:
            raise ConfigError(f"gRPC engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        engine = resolved(engine)
        if engine == "nghttp2" and not engine_available():
            raise ConfigError(
                "the nghttp2 gRPC engine was not built with this package (libnghttp2's headers were "
                "missing when it was installed): install them (Debian: libnghttp2-dev) and reinstall, "
                "or use grpc_engine python"
            )
        self.engine = engine
        self.budget = ByteBudget(
            limits.max_buffered_bytes,
            "the listener's max_buffered_bytes",
            spares=SpareBuffers(limits.max_spare_bytes),
        )
        self.unsent = ByteBudget(limits.max_unsent_bytes, "the listener's max_unsent_bytes")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc")
        self._held_pool = ThreadPoolExecutor(threads, thread_name_prefix="frontdoor-grpc-held")
        self._connections: dict[socket.socket, H2Connection] = {}
        self._connections_lock = threading.Lock()

        def serve(sock: socket.socket) -> float | None:
            with self._connections_lock:
                connection = self._connections.get(sock)
                if connection is None and engine == "nghttp2":
                    connection = self._connections[sock] = EngineConnection(
                        sock,
                        handler,
                        refuse,
                        self._pool,
                        limits,
                        place,
                        self._held_pool,
                        fast,
                        self.budget,
                        self.unsent,
                    )
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
