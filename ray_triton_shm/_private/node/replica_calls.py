"""A node client's calls for a Serve replica: its front door's state and ports, staying attached.

:class:`ReplicaCalls` is the part of :class:`~ray_triton_shm.node.NodeClient`
that a Serve replica uses besides inference: it reports the replica's front
door to the node actor (``ray-triton-shm status`` shows it), asks the actor to
hold the door's fixed ports open between the app's replicas or to let them go,
and attaches again to a node actor that no longer knows the client (one that
restarted, or would retire under an idle app).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import ray

logger = logging.getLogger(__name__)
# Longest a replica waits for the node actor to take or drop its front-door port.
_DOOR_CALL_S = 10.0


class ReplicaCalls:
    """A node client's calls for a Serve replica (see the module docstring); mixed into ``NodeClient``.

    The client sets these attributes and has ``_reconnect_if_changed`` (attaches
    again if Triton or the node actor changed; returns whether it did).
    """

    _actor: ray.actor.ActorHandle | None
    _user_id: str
    _closed: bool

    def report_door(
        self, stats: dict[str, Any], hold: Sequence[tuple[int, str, str, float]] = ()
    ) -> ray.ObjectRef | None:
        """Tell the node actor how this process's front door stands (``status`` shows it).

        ``hold``: the door's fixed ports as :meth:`hold_door` takes them, ``(port,
        app, host, linger_s)``; a node actor that restarted holds them again.

        Returns:
            The actor's answer, whether it knows this client (for
            :meth:`keep_attached`); ``None`` when the report could not be sent.
        """
        actor = self._actor
        if actor is None:
            return None
        try:
            return actor.report_door.remote(self._user_id, stats, list(hold))
        except Exception as e:  # the actor may be restarting: status misses one report
            logger.debug("front-door report failed: %s", e)
            return None

    async def keep_attached(self, answer: ray.ObjectRef | None = None, timeout_s: float = 5.0) -> bool:
        """Attach again if the node actor does not know this client; call it now and then.

        A node actor that restarted knows no user, and one whose users make no
        call (an idle app) would retire after ``idle_shutdown_s``. Serve replicas
        call this from their health checks.

        Args:
            answer: The actor's answer to :meth:`report_door`; ``None``: ask it.
            timeout_s: How long to wait for the answer (no answer: nothing done).

        Returns:
            Whether this client attached again.
        """
        actor = self._actor
        if actor is None or self._closed:
            return False
        try:
            if answer is None:
                answer = actor.knows.remote(self._user_id)
            attached = bool(await asyncio.wait_for(answer, timeout_s))
        except asyncio.TimeoutError:  # the actor busy or restarting: the next call asks again
            return False
        except ray.exceptions.RayError:  # the actor died meanwhile
            attached = False
        if attached:
            return False
        return await asyncio.to_thread(self._reconnect_if_changed)

    def hold_door(self, port: int, app_name: str, host: str, linger_s: float) -> bool:
        """Ask the node actor to keep this app's front-door port open between its replicas.

        The node actor borrows the listening socket from this process (see the
        node actor's ``hold_door``); it lets it go once no replica of the app has
        held it for ``linger_s``.

        Returns:
            Whether the node actor holds the socket (``False`` also when it did not answer in time).
        """
        actor = self._actor
        if actor is None:
            return False
        try:
            return bool(ray.get(actor.hold_door.remote(port, app_name, host, linger_s), timeout=_DOOR_CALL_S))
        except Exception as e:  # the actor restarting or slow: the port closes with the last replica
            logger.warning("front door: the node actor does not hold port %d: %s", port, e)
            return False

    def drop_door(self, port: int, app_name: str) -> None:
        """Tell the node actor to close this app's front-door port with its last replica (app deleted)."""
        actor = self._actor
        if actor is not None:
            try:
                ray.get(actor.drop_door.remote(port, app_name), timeout=_DOOR_CALL_S)
            except Exception as e:  # it lets the port go after its linger time instead
                logger.warning("front door: could not tell the node actor to close port %d: %s", port, e)
