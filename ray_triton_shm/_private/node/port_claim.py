"""Which app a front-door port belongs to on a node, and the one listening socket its replicas share.

Before it listens on a port, a replica claims it: it binds an abstract Unix
socket named after the port, a digest of its app's name and a name of its own,
then lists the claims of that port (``/proc/net/unix``). A claim of another app
means the port is taken: the claim is dropped and the replica refuses to start.
Each side claims before it looks, so of two apps that start at once at least
one sees the other.

Every replica of an app on a node accepts from *one* listening socket: the first
binds it, and each claim then listens on its Unix socket and hands the
listening socket to the app's next replicas (``SCM_RIGHTS``, to processes of the
same user only). One accept queue, shared: a replica that is stopped, hung or
leaving takes no connection, and the others take them all (with a socket per
replica, ``SO_REUSEPORT``, the kernel would go on queueing a share of the new
connections on the stopped one). The node actor borrows the socket too and
holds it under a claim of its own (:mod:`~ray_triton_shm._private.node.held_doors`),
so a redeploy that stops every old replica before its new ones start never
closes the port: connections wait in its queue for the new replicas, which
borrow the socket from the node actor. Should no holder answer (all of them
stopped), a replica binds a socket of its own beside it (``SO_REUSEPORT``).

A claim lives exactly as long as its socket: it is gone when its process closes
it or dies, and it leaves no file behind. The claims are per network namespace,
as the ports are.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import random
import socket
import struct
import threading
import time

from ray_triton_shm.errors import FrontDoorError

logger = logging.getLogger(__name__)

_PREFIX = "ray-triton-shm-frontdoor"
_PROC_NET_UNIX = "/proc/net/unix"
HANDOVER_TIMEOUT_S = 1.0
"""How long a replica waits for another to hand over the listening socket before it asks the next."""
_OPEN_LOCK_S = 10.0
_counter = itertools.count()  # next() on it is atomic


def app_digest(app_name: str) -> str:
    """A short, fixed-length stand-in for ``app_name`` in a claim's socket name."""
    return hashlib.sha256(app_name.encode("utf-8")).hexdigest()[:16]


def claim_names(port: int, path: str = _PROC_NET_UNIX) -> list[str]:
    """The socket names (without the leading ``@``) of every claim of ``port`` in this network namespace."""
    marker = f"@{_PREFIX}:{port}:"
    names = []
    with open(path, encoding="utf-8", errors="replace") as table:
        next(table, None)  # the header
        for line in table:
            name = line.rstrip("\n").rsplit(" ", 1)[-1]
            if name.startswith(marker):
                names.append(name[1:])
    return names


def port_claims(port: int, path: str = _PROC_NET_UNIX) -> list[str]:
    """The app digests of every claim of ``port`` in this network namespace (one per claim)."""
    start = len(f"{_PREFIX}:{port}:")
    return [name[start:].split(":", 1)[0] for name in claim_names(port, path)]


def app_claim_names(port: int, app_name: str) -> list[str]:
    """The socket names of the claims of ``port`` for ``app_name`` (its replicas', its node actor's)."""
    mine = f"{_PREFIX}:{port}:{app_digest(app_name)}:"
    return [n for n in claim_names(port) if n.startswith(mine)]


def bind_listening(host: str, port: int, protocol: str, backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, ``SO_REUSEPORT``) and listening.

    Raises:
        FrontDoorError: The address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise FrontDoorError(f"cannot listen for {protocol} on {host}:{port}: {e}") from e
    return sock


class PortClaim:
    """This process's claim of ``port`` for ``app_name``; held until :meth:`close`.

    Args:
        port: The front-door port (HTTP or gRPC) about to be bound.
        app_name: The Serve app the port is for.

    Raises:
        FrontDoorError: Another app on this node has claimed ``port``.
    """

    def __init__(self, port: int, app_name: str) -> None:
        self.port = port
        self.app_name = app_name
        digest = app_digest(app_name)
        number = next(_counter)
        self._digest = digest
        self._name = f"{_PREFIX}:{port}:{digest}:{os.getpid()}:{number}"
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(f"\0{self._name}")
            others = [d for d in port_claims(port) if d != digest]
        except OSError as e:
            self.close()
            raise FrontDoorError(f"cannot claim front-door port {port} on this node: {e}") from e
        if others:
            self.close()
            raise FrontDoorError(
                f"port {port} is already the front door of another application on this node; "
                f"application {app_name!r} cannot share it (replicas of one application share its ports, "
                "applications do not): give each application ports of its own"
            )

    @property
    def name(self) -> str:
        """The claim's socket name (without the leading NUL)."""
        return self._name

    def listening_socket(self, host: str, protocol: str) -> socket.socket:
        """The app's listening socket on ``host:port``: borrowed from another replica, or bound.

        The claim then hands it to the app's next replicas, until :meth:`close`.

        Raises:
            FrontDoorError: The address cannot be bound.
        """
        with _OpenLock(self.port):
            sock = self.borrow(host)
            if sock is None:
                sock = bind_listening(host, self.port, protocol)
            self.share(sock)
        return sock

    def borrow(self, host: str) -> socket.socket | None:
        """The listening socket on ``host:port`` of another holder of this app's claim (a replica, the node
        actor), if one hands it over."""
        others = [n for n in app_claim_names(self.port, self.app_name) if n != self._name]
        random.shuffle(others)
        for name in others:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as asker:
                asker.settimeout(HANDOVER_TIMEOUT_S)
                try:
                    asker.connect(f"\0{name}")
                    _, fds, _, _ = socket.recv_fds(asker, 1, 1)
                except OSError as e:  # not sharing (yet), gone, or stopped: the next one
                    logger.debug("front door: %s did not hand over port %d: %s", name, self.port, e)
                    continue
            if not fds:
                continue
            sock = socket.socket(fileno=fds[0])
            for extra in fds[1:]:
                os.close(extra)
            try:
                address = sock.getsockname()
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            except OSError:
                sock.close()
                continue
            if listening and address[0] == host and address[1] == self.port:
                return sock
            sock.close()
        return None

    def share(self, listening: socket.socket) -> None:
        """Hand ``listening`` to this app's replicas (same user) that ask, until :meth:`close`."""
        claim = self._sock
        if claim is None:
            raise FrontDoorError(f"the claim of port {self.port} is closed")
        claim.listen(16)
        uid = os.getuid()

        def serve() -> None:
            while True:
                try:
                    conn, _ = claim.accept()
                except OSError:  # the claim closed
                    return
                with conn:
                    try:
                        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                        _, peer_uid, _ = struct.unpack("3i", creds)
                        if peer_uid == uid:
                            conn.settimeout(HANDOVER_TIMEOUT_S)
                            socket.send_fds(conn, [b"L"], [listening.fileno()])
                    except OSError:
                        continue

        self._thread = threading.Thread(target=serve, name=f"frontdoor-share-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Drop the claim (and stop handing over the listening socket). Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def __enter__(self) -> PortClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _OpenLock:
    """Held while a replica borrows or binds a port's listening socket, so two never both bind it.

    An abstract Unix socket (``bind`` is the lock): gone with its process.
    """

    def __init__(self, port: int) -> None:
        self._name = f"\0{_PREFIX}-open:{port}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def __enter__(self) -> _OpenLock:
        deadline = time.monotonic() + _OPEN_LOCK_S
        while True:
            try:
                self._sock.bind(self._name)
                return self
            except OSError:
                if time.monotonic() > deadline:  # a holder is stuck: go on without the lock
                    return self
                time.sleep(0.02)

    def __exit__(self, *exc_info: object) -> None:
        self._sock.close()
