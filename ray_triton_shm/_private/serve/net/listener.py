"""A listening TCP socket (``SO_REUSEPORT``) with a thread per connection, and vectored sends.

Both halves of the front door use it: the HTTP/1.1 listener and the gRPC (HTTP/2) one.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable, Sequence

from ray_triton_shm.errors import FrontDoorError

logger = logging.getLogger(__name__)

IOV_BATCH = 512
"""Buffers handed to one ``sendmsg`` call (the kernel takes at most ``IOV_MAX``, 1024 on Linux)."""


Unsent = Callable[[list[memoryview]], list[memoryview]]
"""Given the views not sent yet, what to send instead (copies of them, say)."""


def send_parts(
    sock: socket.socket,
    parts: Sequence[bytes | memoryview],
    stall_s: float = 0.0,
    on_stall: Unsent | None = None,
) -> None:
    """Write every part to ``sock``, in order, without joining them (``sendmsg``).

    Args:
        sock: A connected blocking socket.
        parts: What to send.
        stall_s: With ``on_stall``: how long a send may wait for the client to take bytes.
        on_stall: Called once, with the views not sent yet, when a send waited
            ``stall_s``; the rest is sent from what it returns (and may take as long
            as the socket's own send timeout allows).

    Raises:
        OSError: The send failed or timed out (``SO_SNDTIMEO``).
    """
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    first = 0
    while first < len(views):
        if on_stall is None:
            sent = sock.sendmsg(views[first : first + IOV_BATCH])
        else:
            try:
                sent = sock.sendmsg(views[first : first + IOV_BATCH], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if not sent:
                if not select.select([], [sock], [], stall_s)[1]:
                    rest = views[first:]
                    views.clear()  # no view of the parts is left here
                    views = on_stall(rest)
                    first = 0
                    del rest
                    on_stall = None
                continue
        while sent:
            size = len(views[first])
            if sent >= size:
                sent -= size
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


class TcpListener:
    """A listening socket (``SO_REUSEPORT``) and a thread per connection, each running ``serve``.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        serve: Runs one connection, in its own thread; the socket is closed after it returns.
        protocol: Named in errors and thread names (``HTTP``, ``gRPC``).
        max_connections: Connections served at once; more wait in the backlog.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        serve: Callable[[socket.socket], None],
        *,
        protocol: str,
        max_connections: int = 256,
    ) -> None:
        self._serve_connection = serve
        self._protocol = protocol
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Condition()
        self._open: set[socket.socket] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            raise FrontDoorError(f"cannot listen for {protocol} on {host}:{port}: {e}") from e
        self._sock = sock
        self.host = host
        self.port = sock.getsockname()[1]
        name = f"frontdoor-{protocol.lower()}-{self.port}"
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            self._slots.acquire()
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                self._slots.release()
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    self._slots.release()
                    return
                self._open.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = f"frontdoor-{self._protocol.lower()}-conn"
            threading.Thread(target=self._serve, args=(conn,), name=name, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        except Exception:
            logger.exception("front door: %s connection failed", self._protocol)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._open.discard(conn)
                self._lock.notify_all()
            self._slots.release()

    def open_connections(self) -> list[socket.socket]:
        """The connections being served now."""
        with self._lock:
            return list(self._open)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening and shut every open connection.

        Returns once every connection's thread has finished with it, or after
        ``wait_s`` seconds (a call still running in one is left to end).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_now = list(self._open)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._sock.close()
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=wait_s)
        with self._lock:
            self._lock.wait_for(lambda: not self._open, timeout=wait_s)
