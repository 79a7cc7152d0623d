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
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import metrics

from ray_triton_shm._private.serve.door.calls import CallRecord
from ray_triton_shm._private.serve.replica_context import access_log_enabled

_ACCESS_LOG = logging.getLogger("ray.serve")
LATENCY_BUCKETS_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


class FrontDoorObserver:
    """Records each front-door call in Prometheus and, where Serve logs access, in the access log.

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
        }

    def follow(self, context: Any) -> None:
        """Take the deployment's access-log setting from Serve's context again (Serve changes it in place)."""
        self._access_log = access_log_enabled(context)

    def __call__(self, record: CallRecord) -> None:
        status = record.status or "-"
        tags = {
            "route": record.route,
            "protocol": record.protocol,
            "method": record.method,
            "status_code": status,
        }
        latency_ms = record.latency_s * 1000.0
        try:
            self._requests.inc(tags=tags)
            self._latency.observe(latency_ms, tags=tags)
        except Exception:  # a metric failure must not fail the call
            pass
        if self._access_log:
            verb = record.method if record.protocol == "http" else "gRPC"
            _ACCESS_LOG.info(
                "%s %s %s %.1fms",
                verb,
                record.route,
                status,
                latency_ms,
                extra={**self._extra, "route": record.route},
            )
