"""Which application a front-door port belongs to on this node, so that two apps never share one.

Every replica of an app binds the app's front-door ports with ``SO_REUSEPORT``
and the kernel spreads connections among them. The kernel would let a replica
of *another* app bind the same port the same way, and then hand it half of the
first app's connections. So before it binds a port, a replica claims it: it
binds an abstract Unix socket named after the port, a digest of its app's name
and a name of its own, then lists the claims of that port
(``/proc/net/unix``). A claim of another app means the port is taken: the claim
is dropped and the replica refuses to start.

Each side claims before it looks, so of two apps that start at once at least
one sees the other. A claim lives exactly as long as its socket: it is gone
when the replica closes it or dies, and it leaves no file behind. The claims
are per network namespace, as the ports are.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket

from ray_triton_shm.errors import FrontDoorError

_PREFIX = "ray-triton-shm-frontdoor"
_PROC_NET_UNIX = "/proc/net/unix"
_counter = itertools.count()  # next() on it is atomic


def app_digest(app_name: str) -> str:
    """A short, fixed-length stand-in for ``app_name`` in a claim's socket name."""
    return hashlib.sha256(app_name.encode("utf-8")).hexdigest()[:16]


def port_claims(port: int, path: str = _PROC_NET_UNIX) -> list[str]:
    """The app digests of every claim of ``port`` in this network namespace (one per claim)."""
    marker = f"@{_PREFIX}:{port}:"
    digests = []
    with open(path, encoding="utf-8", errors="replace") as table:
        next(table, None)  # the header
        for line in table:
            name = line.rstrip("\n").rsplit(" ", 1)[-1]
            if name.startswith(marker):
                digests.append(name[len(marker) :].split(":", 1)[0])
    return digests


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
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(f"\0{_PREFIX}:{port}:{digest}:{os.getpid()}:{number}")
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

    def close(self) -> None:
        """Drop the claim. Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> PortClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
