"""A Serve replica's front door: its reports to the node actor, health, autoscaling stats, drain.

:class:`FrontDoorMixin` is the part of :class:`~ray_triton_shm.serve.TritonDeployment`
that runs with the replica's front door (its own KServe v2 listeners, opened by
the deployment): Serve's health check (the door still accepting, the settings
Serve changed in place), its requests for autoscaling stats (the door's calls),
reports of the door's state to the node actor (for ``ray-triton-shm status``,
with the door's fixed ports, which the actor holds between the app's replicas),
the door's stats and ports over the handle, and the drain when the replica stops.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import ray
from ray import serve

from ray_triton_shm._private.serve.autoscaling import FRONTDOOR_ONGOING
from ray_triton_shm._private.serve.door.batched_observer import BatchedObserver
from ray_triton_shm._private.serve.door.frontdoor import FrontDoor
from ray_triton_shm._private.serve.frontdoor_observe import FrontDoorObserver
from ray_triton_shm._private.serve.replica_context import drain_budget, max_ongoing_requests
from ray_triton_shm.node import NodeClient

logger = logging.getLogger(__name__)

_REPORT_S = 2.0
STATUS_TIMEOUT_S = 2.0
"""What a stopping replica spends asking Serve for its app's status, before the door's drain."""


class FrontDoorMixin:
    """A replica's front door (see the module docstring), as Serve deployment methods.

    The class mixing it in sets these attributes: ``self._frontdoor`` (``None``:
    the app has no front door), ``self._observer`` and ``self._recorder`` (its
    :class:`BatchedObserver`; with a door), ``self._client``,
    ``self._app_name`` and ``self._reported`` (when the door was last reported).
    """

    _client: NodeClient
    _frontdoor: FrontDoor | None
    _observer: FrontDoorObserver
    _recorder: BatchedObserver
    _app_name: str
    _reported: float

    def __del__(self) -> None:
        """Drain the front door, then close it (Serve calls this when the replica stops).

        New connections go to the app's other replicas on this node; calls in
        flight finish within the front door's ``drain_timeout_s``, or less where
        the deployment's ``graceful_shutdown_timeout_s`` (after which Serve kills
        the replica) leaves less.
        """
        door = self.__dict__.get("_frontdoor")
        if door is not None:
            ports = self._fixed_ports()
            self._frontdoor = None  # first: no report after this asks the node to hold the ports again
            if ports and _app_deleted(self._app_name):  # else the node keeps them for the next replicas
                for port in ports:
                    self._client.drop_door(port, self._app_name)
            wait_s = drain_budget(_replica_context(), door.config.drain_timeout_s, STATUS_TIMEOUT_S)
            if not door.drain(wait_s):
                logger.warning("front door: calls still running after %g s were cut", wait_s)
            self._recorder.close()  # the records of the last calls

    def _fixed_ports(self) -> list[int]:
        """The front door's ports named in its config (a port the OS picked is this replica's own)."""
        door = self._frontdoor
        if door is None:
            return []
        return [port for port in (door.config.http_port, door.config.grpc_port) if port]

    async def check_health(self) -> None:
        """Serve's health check: the front door (when the app has one) must be accepting connections.

        Raises:
            FrontDoorError: A listener stopped accepting, or the door's event loop is gone.
        """
        if self._frontdoor is not None:
            self._frontdoor.check()
            self._follow_serve(self._frontdoor)
        await self._report()

    def _follow_serve(self, door: FrontDoor) -> None:
        """The door takes the settings Serve changes in place (a redeploy that changes only them).

        ``max_ongoing_requests`` (the door's bound) and the ``logging_config``'s access
        log: Serve reconfigures the replica it has, and its context then says the new values.
        """
        context = serve.get_replica_context()
        door.calls.limit = max_ongoing_requests(context)
        self._observer.follow(context)

    async def _report(self) -> None:
        """Every few seconds, this replica to the node actor: its front door's state (for
        ``ray-triton-shm status``), and whether the actor knows it.

        From Serve's health checks, which every replica gets, and its requests for
        autoscaling stats, which only an autoscaling deployment's replicas get. A node
        actor that restarted knows no user: the replica attaches again (else, under an
        idle app, the actor would retire), and the door's report names its fixed
        ports, which the actor then holds again.
        """
        now = time.monotonic()
        if now - self._reported < _REPORT_S:
            return
        self._reported = now
        await self._client.keep_attached(self._report_door())

    def _report_door(self) -> ray.ObjectRef | None:
        """The front door's state to the node actor; returns its answer (``None``: no door)."""
        door = self._frontdoor
        if door is None:
            return None
        config = door.config
        hold = [(port, self._app_name, config.host, config.port_linger_s) for port in self._fixed_ports()]
        return self._client.report_door({"pid": os.getpid(), "app": self._app_name, **door.stats()}, hold)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The front door's calls running or waiting for a slot (on average since the previous
        report), which Serve's autoscaler counts with its own requests.

        See :func:`~ray_triton_shm.serve.frontdoor_autoscaling_policy`. Every few seconds the door's
        state also goes to the node actor, for ``ray-triton-shm status``.
        """
        door = self._frontdoor
        if door is None:
            return {FRONTDOOR_ONGOING: 0.0}
        await self._report()
        return {FRONTDOOR_ONGOING: door.calls.mean_demand()}

    async def frontdoor_stats(self) -> dict[str, Any]:
        """This replica's front door: ports, connections, calls and their bound (``{}``: none)."""
        return self._frontdoor.stats() if self._frontdoor is not None else {}

    async def frontdoor_ports(self) -> dict[str, int | None]:
        """The ports this replica's front door listens on (``None``: that protocol has none)."""
        door = self._frontdoor
        return {
            "http": door.http.port if door is not None and door.http is not None else None,
            "grpc": door.grpc.port if door is not None and door.grpc is not None else None,
        }


def _replica_context() -> Any:
    """Serve's context of this replica (``None`` outside one)."""
    try:
        return serve.get_replica_context()
    except Exception:  # outside a replica: no deployment settings apply
        return None


def _app_deleted(app_name: str, timeout_s: float = STATUS_TIMEOUT_S) -> bool:
    """Whether Serve is deleting ``app_name`` (``serve delete``, ``serve shutdown``) or cannot say so in time.

    Asked by a replica as it stops: a redeploy or a downscale leaves the app's
    front-door ports open on the node for its next replicas; a deletion closes them.
    """
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="app-status")
    try:
        application = pool.submit(serve.status).result(timeout=timeout_s).applications.get(app_name)
    except Exception as e:  # the controller gone or busy: as deleted, the ports must not outlive it
        logger.info("front door: Serve's status unknown (%s); closing the app's ports", e)
        return True
    finally:
        pool.shutdown(wait=False)  # a status call that hangs ends with its thread, not with us
    return application is None or application.status == "DELETING"
