"""A listening TCP socket whose idle connections wait in a selector, and vectored sends.

Both halves of the front door use it: the HTTP/1.1 listener and the gRPC (HTTP/2) one.
The listening socket may be shared with other processes (handed over with
``SCM_RIGHTS``): each accepts from the one queue, so a process that stops
accepting leaves new connections to the others. It is non-blocking, waited on
with ``poll``: of the processes woken for a connection, one gets it.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ray_triton_shm._private.node.port_claim import bind_listening

logger = logging.getLogger(__name__)

IOV_BATCH = 512
"""Buffers handed to one ``sendmsg`` call (the kernel takes at most ``IOV_MAX``, 1024 on Linux)."""


def consumed(views: list[memoryview], first: int, sent: int) -> int:
    """The index of the first view not wholly sent after ``sent`` more bytes went from ``views[first:]``.

    A view sent in part is replaced by its unsent rest.
    """
    while sent:
        size = len(views[first])
        if sent >= size:
            sent -= size
            first += 1
        else:
            views[first] = views[first][sent:]
            sent = 0
    return first


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
        first = consumed(views, first, sent)


def send_within(sock: socket.socket, parts: Sequence[bytes | memoryview], stall_s: float) -> list[memoryview]:
    """Write ``parts`` to ``sock`` in order until they are sent or a send waits ``stall_s`` for the
    client to take bytes (``0``: no wait at all); the views not sent (views of ``parts``).

    Raises:
        OSError: The send failed.
    """
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    first = 0
    while first < len(views):
        try:
            sent = sock.sendmsg(views[first : first + IOV_BATCH], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if not sent:
            if stall_s <= 0 or not select.select([], [sock], [], stall_s)[1]:
                return views[first:]
            continue
        first = consumed(views, first, sent)
    return []


IDLE_LINGER_S = 0.1
"""How long a connection with nothing to do keeps its thread for its next request before it is
parked (a client calling back to back is served without a hand-over between threads)."""

MAX_OPEN = 4096
"""Connections a listener keeps open at once, idle ones included; past it a new one is closed at once."""


Serve = Callable[[socket.socket], "float | None"]
"""Serves a connection while it has work, in a thread of the listener's: returns ``None`` when the
connection is over (the listener closes it), or the seconds it may then wait, parked in the
listener's selector with no thread of its own, for its next bytes (after which ``serve`` is
called again in a thread, or ``expire`` is called and it is closed)."""


class TcpListener:
    """A listening socket: connections served in threads while busy, parked while idle.

    A new connection, and one whose ``serve`` returned a wait, sits in one
    selector (no thread of its own) until it has bytes to read; then ``serve``
    runs for it in a thread. At most ``max_connections`` connections are served
    at once (more wait in the selector's queue), and at most :data:`MAX_OPEN`
    are open, idle ones included. Thousands of idle sockets cost no thread.

    Args:
        host: Address to bind.
        port: Port to bind (``0``: one the OS picks; see :attr:`port`).
        serve: See :data:`Serve`; the socket is closed after it returns ``None``.
        listening: A listening socket to accept from instead of binding one (its
            ``host`` and ``port``; another process may accept from it too). The
            listener owns it: :meth:`close` closes this process's copy.
        protocol: Named in errors and thread names (``HTTP``, ``gRPC``).
        max_connections: Connections served at once (a thread each).
        first_wait_s: How long a new connection may wait for its first byte.
        expire: Called (in the selector's thread, briefly) for a connection parked too
            long, before it is closed (a goodbye such as GOAWAY, say).
        max_open: Connections open at once, idle ones included.

    Raises:
        FrontDoorError: The address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        serve: Serve,
        *,
        protocol: str,
        max_connections: int = 256,
        first_wait_s: float = 10.0,
        expire: Callable[[socket.socket], None] | None = None,
        max_open: int = MAX_OPEN,
        listening: socket.socket | None = None,
    ) -> None:
        self._serve_connection = serve
        self._expire = expire
        self._protocol = protocol
        self._first_wait_s = first_wait_s
        self._max_open = max_open
        self._lock = threading.Condition()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._accepting = True
        self._draining = False
        sock = listening if listening is not None else bind_listening(host, port, protocol)
        sock.setblocking(False)
        self._sock = sock
        self._wake_r, self._wake_w = socket.socketpair()
        self.host = host
        self.port = sock.getsockname()[1]
        self._parked = _Parking(self._run, self._expired, f"frontdoor-{protocol.lower()}-{self.port}-idle")
        prefix = f"frontdoor-{protocol.lower()}-conn"
        self._workers = ThreadPoolExecutor(max_connections, thread_name_prefix=prefix)
        name = f"frontdoor-{protocol.lower()}-{self.port}"
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            poller.poll()
            if not self._accepting:
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):  # another process (or nobody) took it
                continue
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.01 if e.errno == errno.ECONNABORTED else 0.1)
                    continue
                logger.error("front door: %s listener stops accepting: %s", self._protocol, e)
                return
            conn.setblocking(True)
            with self._lock:
                if self._closed or len(self._open) >= self._max_open:
                    full = not self._closed
                    conn.close()
                    if full:
                        logger.warning(
                            "front door: %s connection refused (%d open)", self._protocol, self._max_open
                        )
                        continue
                    return
                self._open.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._parked.park(conn, self._first_wait_s)

    def _run(self, conn: socket.socket) -> None:
        """A parked connection has bytes: serve it in a worker thread."""
        try:
            self._workers.submit(self._serve, conn)
        except RuntimeError:  # shut down: the listener is closing
            self._end(conn)

    def _serve(self, conn: socket.socket) -> None:
        wait: float | None = None
        try:
            wait = self._serve_connection(conn)
        except Exception:
            logger.exception("front door: %s connection failed", self._protocol)
        if wait is None or self._closed:
            self._end(conn)
        else:
            self._parked.park(conn, wait)

    def _expired(self, conn: socket.socket) -> None:
        if self._expire is not None:
            try:
                self._expire(conn)
            except Exception:
                logger.exception("front door: %s idle connection's goodbye failed", self._protocol)
        self._end(conn)

    def _end(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.close()
        with self._lock:
            self._open.discard(conn)
            self._lock.notify_all()

    @property
    def accepting(self) -> bool:
        """Whether new connections are still taken from the listening socket (its thread alive)."""
        return self._accepting and self._thread.is_alive()

    def stop_accepting(self, wait_s: float = 5.0) -> None:
        """Take no new connection and close this process's copy of the listening socket.

        Connections already accepted go on. Where another process shares the
        listening socket, new connections go to it; where none does, the port
        closes. Idempotent.
        """
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def open_connections(self) -> list[socket.socket]:
        """The connections open now, idle ones included."""
        with self._lock:
            return list(self._open)

    @property
    def draining(self) -> bool:
        """Whether the listener is draining: answers should end their connections."""
        return self._draining

    def drain(self, wait_s: float, quiet_s: float = 0.5) -> bool:
        """Stop accepting, then let the open connections finish; each closes once quiet.

        A connection idle (parked) for ``quiet_s`` is closed (its ``expire``
        goodbye first); one with work goes on, and the serving code sees
        :attr:`draining` (an HTTP answer then ends its connection, HTTP/2 sends GOAWAY).

        Returns:
            Whether every connection ended within ``wait_s`` seconds.
        """
        self._draining = True
        self.stop_accepting(wait_s)
        self._parked.cap(quiet_s)
        with self._lock:
            return self._lock.wait_for(lambda: not self._open, timeout=wait_s)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening and shut every open connection.

        Returns once every connection's thread has finished with it, or after
        ``wait_s`` seconds (a call still running in one is left to end).
        Idempotent.
        """
        self.stop_accepting(wait_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_now = list(self._open)
        for conn in self._parked.close():
            self._end(conn)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._lock.wait_for(lambda: not self._open, timeout=wait_s)
        self._workers.shutdown(wait=False)


class _Parking:
    """Idle connections in one selector: each to ``ready`` once it has bytes, or ``expired`` once due.

    Args:
        ready: Called with a connection that became readable (no longer parked).
        expired: Called with a connection parked past its time (no longer parked).
        name: The selector thread's name.
    """

    def __init__(
        self, ready: Callable[[socket.socket], None], expired: Callable[[socket.socket], None], name: str
    ) -> None:
        self._ready = ready
        self._expired = expired
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._incoming: list[tuple[socket.socket, float]] = []
        self._deadlines: list[tuple[float, int, socket.socket]] = []  # a heap; entries of unparked ones stay
        self._parked: dict[socket.socket, float] = {}
        self._count = itertools.count()
        self._closed = False
        self._cap_s: float | None = None
        self._recap = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def park(self, conn: socket.socket, wait_s: float) -> None:
        """Wait for ``conn``'s next bytes, at most ``wait_s`` seconds, with no thread of its own."""
        with self._lock:
            closed = self._closed
            if not closed:
                if self._cap_s is not None:
                    wait_s = min(wait_s, self._cap_s)
                self._incoming.append((conn, time.monotonic() + wait_s))
        if closed:  # the listener is closing: the connection ends now
            self._expired(conn)
            return
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def cap(self, wait_s: float) -> None:
        """From now on no connection stays parked longer than ``wait_s`` seconds (from now)."""
        with self._lock:
            self._cap_s = wait_s
            self._recap = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                incoming, self._incoming = self._incoming, []
                recap, self._recap = self._recap, False
                cap_s = self._cap_s
            if recap and cap_s is not None:
                latest = time.monotonic() + cap_s
                for conn, deadline in list(self._parked.items()):
                    if deadline > latest:
                        self._parked[conn] = latest
                        heapq.heappush(self._deadlines, (latest, next(self._count), conn))
            for conn, deadline in incoming:
                try:
                    self._selector.register(conn, selectors.EVENT_READ)
                except (ValueError, OSError):  # closed meanwhile
                    continue
                self._parked[conn] = deadline
                heapq.heappush(self._deadlines, (deadline, next(self._count), conn))
            now = time.monotonic()
            while self._deadlines:
                deadline, _, conn = self._deadlines[0]
                current = self._parked.get(conn) == deadline  # not unparked or parked again since
                if current and deadline > now:
                    break
                heapq.heappop(self._deadlines)
                if current:  # its time is up
                    self._unpark(conn)
                    self._expired(conn)
            timeout = max(0.0, self._deadlines[0][0] - now) if self._deadlines else None
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                conn = key.fileobj
                self._unpark(conn)  # type: ignore[arg-type]
                self._ready(conn)  # type: ignore[arg-type]

    def _unpark(self, conn: socket.socket) -> None:
        self._parked.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn)

    def close(self) -> list[socket.socket]:
        """Stop; returns the connections that were parked (and those about to be)."""
        with self._lock:
            self._closed = True
            incoming, self._incoming = self._incoming, []
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        parked = list(self._parked) + [conn for conn, _ in incoming]
        self._parked.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        return parked
