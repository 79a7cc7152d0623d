"""The front-door listening sockets a node actor holds for its apps, between their replicas.

A replica's front door on a fixed port accepts from the one listening socket
that every replica of its app on the node shares (see
:mod:`~ray_triton_shm._private.node.port_claim`). Without another holder, the
socket closes with the last replica; a redeploy that stops every old replica
before its new ones start (Serve does so when it also lowers the replica
count) would then refuse connections until a new replica binds the port again.

The node actor outlives replicas, so it borrows the socket too, under a claim
of its own, and never accepts from it: while no replica holds the socket,
connections wait in its queue, and the next replica borrows the socket from
the node actor. The node actor lets it go once no replica of the app has held
it for the app's linger time, at once when a leaving replica says its app is
being deleted or once the socket no longer listens (destroyed from outside), and
when the node actor stops. A node actor that restarts holds
nothing; each replica's reports (every few seconds) name its ports, and the
node actor holds them again.

Example:
    >>> doors = HeldDoors()
    >>> doors.hold(8100, "triton", "0.0.0.0", linger_s=30.0)  # a replica listens on 8100
    True
    >>> doors.sweep()  # often: lets go of a port no replica held for its linger time
    >>> doors.close()
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from ray_triton_shm._private.node.port_claim import PortClaim, app_claim_names
from ray_triton_shm.errors import FrontDoorError

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    claim: PortClaim
    sock: socket.socket
    host: str
    linger_s: float
    alone_since: float | None = None  # since when no replica has held the socket


class HeldDoors:
    """Listening sockets held for apps' front doors, keyed by ``(port, app name)``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, str], _Held] = {}

    def hold(self, port: int, app_name: str, host: str, linger_s: float, *, again: bool = False) -> bool:
        """Borrow the listening socket of ``app_name`` on ``host:port`` from its replicas, and keep it.

        Called by each replica whose front door listens on a fixed port when the
        door opens (a port already held gets ``linger_s`` as its new linger time;
        one held on another address is let go and the new one held), and again
        with each of its reports (``again``), so that a holder that restarted, and
        so holds nothing, holds the port again.

        Args:
            port: The front-door port.
            app_name: The Serve app whose replicas share the port.
            host: The address the replicas listen on.
            linger_s: How long to keep the socket once no replica holds it
                (0: let it go with the last replica).
            again: A replica repeating its request: a port held already keeps
                its linger time (which :meth:`drop` may have set to 0).

        Returns:
            Whether the socket is held now (no replica handed it over: ``False``).
        """
        key = (port, app_name)
        with self._lock:
            held = self._held.get(key)
            if held is not None and _listening(held.sock) and (again or held.host == host):
                if not again:
                    held.linger_s = linger_s
                return True
            if held is not None:
                # A replica of the app on another address (a redeploy changed the host): the old
                # socket, with nobody to accept from it once its replicas leave, would otherwise
                # take the connections to its address. Its replicas keep their own copies. Or the
                # socket stopped listening (destroyed from outside, ``ss -K``): the replicas that
                # met it failed their health checks, and their successors bound a new one.
                why = f"moves from {held.host}" if _listening(held.sock) else "stopped listening"
                del self._held[key]
                _let_go(held)
                logger.info(
                    "node: port %d of app %r %s; holding the replicas' socket on %s",
                    port,
                    app_name,
                    why,
                    host,
                )
            try:
                claim = PortClaim(port, app_name)
            except FrontDoorError as e:  # another app has the port (its replica was refused first)
                logger.warning("node: not holding front-door port %d for %r: %s", port, app_name, e)
                return False
            sock = claim.borrow(host)
            if sock is None:
                claim.close()
                return False
            claim.share(sock)
            self._held[key] = _Held(claim, sock, host, linger_s)
        logger.info("node: holding front-door port %d of app %r between its replicas", port, app_name)
        return True

    def drop(self, port: int, app_name: str) -> None:
        """Let the socket go as soon as no replica holds it (its app is being deleted)."""
        with self._lock:
            held = self._held.get((port, app_name))
            if held is not None:
                held.linger_s = 0.0

    def sweep(self, now: float | None = None) -> list[tuple[int, str]]:
        """Let go of each socket that no replica has held for its linger time; returns their keys."""
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for key, held in list(self._held.items()):
                port, app_name = key
                if not _listening(held.sock):  # the next replica's report holds its new socket
                    del self._held[key]
                    gone.append((key, held))
                    continue
                if [n for n in app_claim_names(port, app_name) if n != held.claim.name]:
                    held.alone_since = None
                    continue
                if held.alone_since is None:
                    held.alone_since = now
                if now - held.alone_since >= held.linger_s:
                    del self._held[key]
                    gone.append((key, held))
        for (port, app_name), held in gone:
            _let_go(held)
            logger.info("node: front-door port %d of app %r closed (no replica holds it)", port, app_name)
        return [key for key, _ in gone]

    def ports(self) -> list[dict[str, Any]]:
        """What is held: port, app, whether a replica holds the socket too (at the last sweep), and
        whether it listens."""
        with self._lock:
            return [
                {
                    "port": port,
                    "app": app_name,
                    "replicas_away": held.alone_since is not None,
                    "listening": _listening(held.sock),
                }
                for (port, app_name), held in sorted(self._held.items())
            ]

    def close(self) -> None:
        """Let go of every socket. Idempotent."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            _let_go(h)


def _listening(sock: socket.socket) -> bool:
    """Whether ``sock`` still listens (one destroyed from outside, ``ss -K``, no longer does)."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


def _let_go(held: _Held) -> None:
    held.claim.close()  # first: no replica borrows the socket while it closes
    held.sock.close()
