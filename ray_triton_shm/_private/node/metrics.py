"""Prometheus metrics through ``ray.util.metrics``, and traffic counters for ``status``.

Ray exports these on each node's metrics endpoint (``ray_`` prefixed, so
``triton_shm_bytes`` is scraped as ``ray_triton_shm_bytes_total``) and on the
dashboard's Grafana:

========================================  =========  ======================  ==========================
metric                                    kind       tags                    recorded by
========================================  =========  ======================  ==========================
``triton_shm_requests``                   counter    model, path             clients (NodeClient)
``triton_shm_bytes``                      counter    model, path             clients: input + output
``triton_shm_request_seconds``            histogram  model, path             clients
``triton_shm_lease_wait_seconds``         histogram  model                   clients: wait for a slot
``triton_shm_errors``                     counter    model, type             clients: error class name
``triton_shm_pool_slots``                 gauge      node, model, state      node actor: free/granted/
                                                                             quarantined
``triton_shm_pool_utilization``           gauge      node, model             node actor: 1 - free/slots
``triton_shm_triton_restarts``            counter    node                    node actor
========================================  =========  ======================  ==========================

``path`` is ``shm``, ``cuda_shm`` or ``grpc`` (plain gRPC, also the
small-request fallback of ``PoolConfig.min_shm_bytes``).

Bytes moved for ``ray-triton-shm status``: data never goes through the node
actor, so each client adds up its requests and bytes by (model, path) and
sends the sums to its node actor fire-and-forget from a background thread,
every :data:`REPORT_INTERVAL_S` while there is something to report, and when
it closes. The same thread records the Prometheus metrics. A report costs at
most four small actor calls per second per client whatever the request rate,
and nothing on the request path but appending the event to a queue. A client
killed without closing (Ray Data kills its map actors when a job ends) loses
at most its last quarter second from ``status`` and from the metrics; the
Prometheus counters of such a process can lose more (what it recorded since
Ray last exported its metrics).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from ray_triton_shm._private.triton.observe import EventBatch, EventSums

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.25
_LATENCY_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None


def _get() -> dict[str, Any]:
    """This process's metric objects (created on first use: Ray must be initialised)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = {
                "requests": Counter(
                    "triton_shm_requests",
                    description="Inference requests answered by Triton, by transport path.",
                    tag_keys=("model", "path"),
                ),
                "bytes": Counter(
                    "triton_shm_bytes",
                    description="Input plus output tensor bytes moved, by transport path.",
                    tag_keys=("model", "path"),
                ),
                "request_seconds": Histogram(
                    "triton_shm_request_seconds",
                    description="Time from sending a request to Triton to having its answer.",
                    boundaries=_LATENCY_BOUNDARIES,
                    tag_keys=("model", "path"),
                ),
                "lease_wait": Histogram(
                    "triton_shm_lease_wait_seconds",
                    description="Time a request waited for a free shared-memory slot.",
                    boundaries=_LATENCY_BOUNDARIES,
                    tag_keys=("model",),
                ),
                "errors": Counter(
                    "triton_shm_errors",
                    description="Failed calls by error type.",
                    tag_keys=("model", "type"),
                ),
                "pool_slots": Gauge(
                    "triton_shm_pool_slots",
                    description="Slots of a node's pool by state (free, granted, quarantined).",
                    tag_keys=("node", "model", "state"),
                ),
                "pool_utilization": Gauge(
                    "triton_shm_pool_utilization",
                    description="Fraction of a node's pool slots that are not free.",
                    tag_keys=("node", "model"),
                ),
                "restarts": Counter(
                    "triton_shm_triton_restarts",
                    description="Times a node actor restarted its Triton after it died.",
                    tag_keys=("node",),
                ),
            }
        return _metrics


class RayMetricsObserver(EventBatch):
    """Client-side :class:`~ray_triton_shm._private.triton.observe.Observer` for Ray processes.

    A request only queues its event (see :class:`EventBatch`); a background
    thread adds them up every :data:`REPORT_INTERVAL_S` and records the sums:
    one increment per counter and (model, path), one observation per request
    in the histograms, and the traffic sums sent to the node actor. The
    metrics report the same totals as one record per request, at most an
    interval later; :meth:`flush` and :meth:`close` record what is queued now.

    Args:
        actor: The node actor to report traffic to (its ``report`` method); ``None`` skips reports.
    """

    def __init__(self, actor: Any | None = None) -> None:
        super().__init__()
        self._actor = actor
        self._metrics = _get()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reporter: threading.Thread | None = None

    def request(self, model: str, path: str, nbytes: int, seconds: float) -> None:
        super().request(model, path, nbytes, seconds)
        if self._reporter is None:
            self._start_reporter()

    def lease_wait(self, model: str, seconds: float) -> None:
        super().lease_wait(model, seconds)
        if self._reporter is None:
            self._start_reporter()

    def error(self, model: str, kind: str) -> None:
        super().error(model, kind)
        if self._reporter is None:
            self._start_reporter()

    def _start_reporter(self) -> None:
        with self._lock:
            if self._reporter is None and not self._closed.is_set():
                self._reporter = threading.Thread(target=self._report_loop, name="rtshm-report", daemon=True)
                self._reporter.start()

    def _report_loop(self) -> None:
        while not self._closed.wait(REPORT_INTERVAL_S):
            if self.queued():
                self.flush()

    def close(self) -> None:
        """Stop the reporting thread and record and send what is left. Idempotent."""
        with self._lock:
            self._closed.set()
            reporter = self._reporter
        if reporter is not None and reporter is not threading.current_thread():
            reporter.join(timeout=5)
        self.flush()

    def flush(self) -> None:
        """Record the events queued so far and send their traffic sums to the node actor (fire-and-forget)."""
        sums = self.drain()
        if not sums:
            return
        try:
            _record(self._metrics, sums)
        except Exception as e:  # a metric failure must not stop the traffic report
            logger.debug("recording metrics failed: %s", e)
        pending = [(model, path, n, nbytes) for (model, path), (n, nbytes) in sums.requests.items()]
        if pending and self._actor is not None:
            try:
                self._actor.report.remote(pending)
            except Exception as e:  # the actor may be restarting; status loses this batch only
                logger.debug("traffic report failed: %s", e)


def _record(metrics: dict[str, Any], sums: EventSums) -> None:
    """Record ``sums`` in the Prometheus metrics: the totals of one record per event."""
    for (model, path), (requests, nbytes) in sums.requests.items():
        tags = {"model": model, "path": path}
        metrics["requests"].inc(requests, tags=tags)
        if nbytes:
            metrics["bytes"].inc(nbytes, tags=tags)
        observe = metrics["request_seconds"].observe
        for seconds in sums.request_seconds[(model, path)]:
            observe(seconds, tags=tags)
    for model, waits in sums.lease_waits.items():
        tags = {"model": model}
        observe = metrics["lease_wait"].observe
        for seconds in waits:
            observe(seconds, tags=tags)
    for (model, kind), count in sums.errors.items():
        metrics["errors"].inc(count, tags={"model": model, "type": kind})


def record_pool_gauges(node: str, pools: dict[str, dict[str, int]]) -> None:
    """Set the pool gauges of ``node`` from ``NodePools.stats()``."""
    metrics = _get()
    for model, stats in pools.items():
        for state in ("free", "in_use", "quarantined"):
            metrics["pool_slots"].set(stats[state], tags={"node": node, "model": model, "state": state})
        used = 1.0 - stats["free"] / stats["slots"] if stats["slots"] else 0.0
        metrics["pool_utilization"].set(used, tags={"node": node, "model": model})


def record_restart(node: str) -> None:
    """Count one Triton restart on ``node``."""
    _get()["restarts"].inc(1, tags={"node": node})
