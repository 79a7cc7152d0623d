"""The front door's calls: counted for Serve's autoscaler, bounded by ``max_ongoing_requests``, observed.

Serve counts, bounds, measures and logs the requests its router hands a
replica; the front door's calls never pass that router, so the door does the
same for its own: :class:`CallGate` counts the calls running (reported to
Serve's autoscaler), refuses one past the deployment's ``max_ongoing_requests``
and hands each finished call to an observer (Serve's metrics and access log).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ray_triton_shm.errors import OverloadedError


@dataclass
class CallRecord:
    """One front-door call, as its observer sees it once it ends.

    Attributes:
        protocol: ``http`` or ``grpc``.
        method: The HTTP method, or the gRPC method's name (``ModelInfer``, ...).
        route: The HTTP path, or the gRPC method's path.
        status: The HTTP status code, or the gRPC status name (``OK``, ``UNAVAILABLE``, ...);
            empty when the call ended without an answer (the client went).
        latency_s: From the call's start to its end.
    """

    protocol: str
    method: str
    route: str
    status: str = ""
    latency_s: float = 0.0


Observer = Callable[[CallRecord], None]


class CallGate:
    """Counts the calls a replica's front door runs, and refuses one past ``limit``.

    Args:
        limit: Calls running at once (``None``: no bound).
        observer: Called with each call's record once it ends (also a refused one's),
            in the call's thread; it must be quick and must not raise.
    """

    def __init__(self, limit: int | None = None, observer: Observer | None = None) -> None:
        self.limit = limit
        self.observer = observer
        self._lock = threading.Lock()
        self._ongoing = 0
        self._total = 0
        self._refused = 0

    @contextlib.contextmanager
    def call(self, protocol: str = "", method: str = "", route: str = "") -> Iterator[CallRecord]:
        """One call, counted while it runs; the caller sets its record's ``status``.

        Raises:
            OverloadedError: ``limit`` calls are running already.
        """
        record = CallRecord(protocol, method, route)
        start = time.perf_counter()
        with self._lock:
            full = self.limit is not None and self._ongoing >= self.limit
            if full:
                self._refused += 1
            else:
                self._ongoing += 1
                self._total += 1
        if full:
            record.status = "503" if protocol == "http" else "UNAVAILABLE"
            self._observe(record, start)
            raise OverloadedError(self.limit or 0)
        try:
            yield record
        finally:
            with self._lock:
                self._ongoing -= 1
            self._observe(record, start)

    def _observe(self, record: CallRecord, start: float) -> None:
        if self.observer is not None:
            record.latency_s = time.perf_counter() - start
            self.observer(record)

    @property
    def ongoing(self) -> int:
        """Calls running now."""
        return self._ongoing

    @property
    def total(self) -> int:
        """Calls taken since the door opened."""
        return self._total

    @property
    def refused(self) -> int:
        """Calls refused for the bound since the door opened."""
        return self._refused
