"""The front door's calls in flight: counted for Serve's autoscaler, bounded by ``max_ongoing_requests``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ray_triton_shm.errors import OverloadedError


class CallGate:
    """Counts the calls a replica's front door runs, and refuses one past ``limit``.

    Serve bounds the requests it routes to a replica by the deployment's
    ``max_ongoing_requests``; the front door's calls do not pass Serve's router,
    so the door bounds them itself, by the same number.

    Args:
        limit: Calls running at once (``None``: no bound).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ongoing = 0
        self._total = 0
        self._refused = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One call, counted while it runs.

        Raises:
            OverloadedError: ``limit`` calls are running already.
        """
        with self._lock:
            if self.limit is not None and self._ongoing >= self.limit:
                self._refused += 1
                raise OverloadedError(self.limit)
            self._ongoing += 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                self._ongoing -= 1

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
