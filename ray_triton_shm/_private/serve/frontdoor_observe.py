"""The front door's calls in Serve's metrics and access log, with Serve's labels.

Serve records each request its router hands a replica (a counter and a latency
histogram tagged with the application, deployment, replica and route) and
writes an access-log line (``POST /route 200 3.2ms``) in the replica's log. The
front door's calls never pass that router; :class:`FrontDoorObserver` records
them alike: ``triton_shm_frontdoor_requests`` and ``triton_shm_frontdoor_latency_ms``
(``ray_triton_shm_frontdoor_requests_total`` and ``ray_triton_shm_frontdoor_latency_ms_*``
on Prometheus, after Ray's prefix; ``ray.serve.metrics``, which adds
``application``, ``deployment`` and ``replica``; plus ``route``, ``protocol``,
``method`` and ``status_code``), and the access-log line through Serve's own
logger, unless the deployment's ``logging_config`` turns access logs off.

A call's thread only queues its record: a
:class:`~ray_triton_shm._private.serve.door.batched_observer.BatchedObserver` hands the
records to :class:`FrontDoorObserver` in batches (at most 0.1 s after the call ends), and
each access-log line is dated when its call ended.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ray.serve import metrics

from ray_triton_shm._private.serve.door.batched_observer import Ended
from ray_triton_shm._private.serve.replica_context import access_log_enabled

_ACCESS_LOG = logging.getLogger("ray.serve")
_RAY_TIMESTAMP = "_ray_timestamp_ns"  # set on each record by Ray's log record factory
LATENCY_BUCKETS_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


class FrontDoorObserver:
    """Records front-door calls in Prometheus and, where Serve logs access, in the access log.

    It takes batches of calls: a :class:`BatchedObserver` around it is the door's observer.

    Args:
        context: Serve's replica context (``serve.get_replica_context()``).
    """

    def __init__(self, context: Any) -> None:
        tags = ("route", "protocol", "method", "status_code")
        self._requests = metrics.Counter(
            "triton_shm_frontdoor_requests",
            description="Calls answered by the replica's front door (its own KServe v2 listeners).",
            tag_keys=tags,
        )
        self._latency = metrics.Histogram(
            "triton_shm_frontdoor_latency_ms",
            description="Time a front-door call took in the replica, from its request to its answer.",
            boundaries=LATENCY_BUCKETS_MS,
            tag_keys=tags,
        )
        self._access_log = access_log_enabled(context)
        app = getattr(context, "app_name", "")
        deployment = getattr(context, "deployment", "")
        self._extra = {
            "deployment": f"{app}_{deployment}" if app else deployment,
            "replica": getattr(context, "replica_tag", ""),
            "application": app,
            "component_name": "replica",
            "skip_context_filter": True,
            "serve_access_log": True,
            "log_to_stderr": False,  # as Serve's own access lines: the replica's log file, not the console
        }

    def follow(self, context: Any) -> None:
        """Take the deployment's access-log setting from Serve's context again (Serve changes it in place)."""
        self._access_log = access_log_enabled(context)

    def __call__(self, batch: Sequence[Ended]) -> None:
        """Record a batch of calls (see :class:`BatchedObserver`): each call's latency and access-log
        line, stamped with the time it ended; the counter once per set of tags."""
        counts: dict[tuple[str, str, str, str], tuple[int, dict[str, str]]] = {}
        logging_on = self._access_log and _ACCESS_LOG.isEnabledFor(logging.INFO)
        where = _ACCESS_LOG.findCaller() if logging_on else None  # the same for every line
        for record, ended in batch:
            status = record.status or "-"
            key = (record.route, record.protocol, record.method, status)
            count, tags = counts.get(key) or (0, _tags(key))
            counts[key] = (count + 1, tags)
            latency_ms = record.latency_s * 1000.0
            try:
                self._latency.observe(latency_ms, tags=tags)
            except Exception:  # a metric failure must not stop the recording
                pass
            if where is not None:
                verb = record.method if record.protocol == "http" else "gRPC"
                extra = {**self._extra, "route": record.route}
                _log_line(where, ended, (verb, record.route, status, latency_ms), extra)
        for count, tags in counts.values():
            try:
                self._requests.inc(count, tags=tags)
            except Exception:
                pass


def _log_line(
    where: tuple[Any, ...], ended: float, args: tuple[object, ...], extra: dict[str, object]
) -> None:
    """Serve's access-log line, through Serve's own logger and handlers, dated when the call ended.

    ``where`` is the ``findCaller()`` the line names as its source.
    """
    fn, lno, func, _ = where
    line = _ACCESS_LOG.makeRecord(
        _ACCESS_LOG.name, logging.INFO, fn, lno, "%s %s %s %.1fms", args, None, func, extra
    )
    line.created = ended
    line.msecs = int((ended - int(ended)) * 1000) + 0.0
    if _RAY_TIMESTAMP in line.__dict__:  # what Ray's JSON lines are dated by
        line.__dict__[_RAY_TIMESTAMP] = int(ended * 1e9)
    _ACCESS_LOG.handle(line)


def _tags(key: tuple[str, str, str, str]) -> dict[str, str]:
    route, protocol, method, status = key
    return {"route": route, "protocol": protocol, "method": method, "status_code": status}
