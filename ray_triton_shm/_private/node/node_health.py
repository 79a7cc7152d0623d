"""When a node's Triton counts as unhealthy, and when to restart it: a small state machine with backoff.

Pure Python (no Ray, no server): the node actor feeds it the result of each
readiness probe and asks it whether to restart now; tests drive it with a
fake clock.

Example:
    >>> monitor = HealthMonitor(unhealthy_after_s=10.0, clock=lambda: 0.0)
    >>> monitor.observe(ready=True, alive=True)
    False
    >>> monitor.snapshot()["state"]
    'ok'

States:
    ``ok``: the last probe answered ready.
    ``unready``: probes fail, for less than ``unhealthy_after_s`` so far.
    ``backoff``: Triton is unhealthy (dead, or unready for ``unhealthy_after_s``)
        but the previous restart was too recent; the next one waits
        (``next_attempt_in_s``).
    ``restarting``: a restart is under way.

A dead process is unhealthy at once; a live one that does not answer
readiness is unhealthy once its probes have failed for ``unhealthy_after_s``,
counted from the start of the first failed probe of the run (so a health
thread that got no CPU for a while does not count as a failing server).
The first restart of a streak happens at once; each further one waits
``backoff_s * 2**(n - 1)`` (at most ``backoff_max_s``) after the end of the
previous one, ``n`` being the restarts so far in the streak. The streak ends
(``consecutive_failures`` back to 0) once Triton has stayed ready for
``stable_after_s`` after a restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ray_triton_shm.errors import ConfigError

STATES = ("ok", "unready", "backoff", "restarting")


class HealthMonitor:
    """Tracks readiness probes and restarts of one Triton; decides when to restart it.

    Thread-safe: the health thread observes and restarts while actor methods
    read :meth:`snapshot`.

    Args:
        unhealthy_after_s: How long a live Triton may fail readiness before it is restarted.
        backoff_s: Wait before the second restart of a streak; doubles for each further one.
        backoff_max_s: Longest wait between restarts.
        stable_after_s: Ready time after a restart that ends a streak; default ``backoff_max_s``.
        clock: Monotonic seconds (``time.monotonic``; a fake in tests).

    Raises:
        ConfigError: A negative or zero duration.
    """

    def __init__(
        self,
        unhealthy_after_s: float,
        *,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        stable_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not unhealthy_after_s > 0:
            raise ConfigError(f"unhealthy_after_s must be > 0, got {unhealthy_after_s!r}")
        if not backoff_s >= 0 or not backoff_max_s >= backoff_s:
            raise ConfigError(f"need 0 <= backoff_s <= backoff_max_s, got {backoff_s!r}, {backoff_max_s!r}")
        self.unhealthy_after_s = float(unhealthy_after_s)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.stable_after_s = float(backoff_max_s if stable_after_s is None else stable_after_s)
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._state = "ok"
        self._failing_since: float | None = None  # start of the first failed probe of this run
        self._failures = 0  # restarts (successful or not) in the current streak
        self._restarts = 0  # restarts that brought a server up, ever
        self._last_restart_end: float | None = None
        self._last_restart_s: float | None = None  # how long the last restart took
        self._next_attempt = now
        self._started = now
        self._last_error = ""

    def delay_after(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th restart of a streak before the next one."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** (failures - 1))

    def observe(self, *, ready: bool, alive: bool, started_at: float | None = None) -> bool:
        """Record one probe; return whether to restart now.

        Args:
            ready: The server answered live and ready within the probe's timeout.
            alive: Its process exists (a stopped process is alive).
            started_at: When the probe started (the monitor's clock); default now.

        Returns:
            True when the caller should restart Triton now; the monitor is then
            ``restarting`` until :meth:`restart_finished`.
        """
        with self._lock:
            now = self._clock()
            if self._state == "restarting":
                return False
            if ready and alive:
                self._state = "ok"
                self._failing_since = None
                ended = self._last_restart_end
                if self._failures and ended is not None and now - ended >= self.stable_after_s:
                    self._failures = 0
                return False
            if self._failing_since is None:
                self._failing_since = now if started_at is None else min(started_at, now)
            unhealthy = not alive or now - self._failing_since >= self.unhealthy_after_s
            if not unhealthy:
                self._state = "unready"
                return False
            if now < self._next_attempt:
                self._state = "backoff"
                return False
            self._state = "restarting"  # only one caller gets True; the next observe waits for it
            self._started = now
            return True

    def restart_started(self) -> None:
        """A restart begins that :meth:`observe` did not ask for (e.g. an operator's)."""
        with self._lock:
            self._state = "restarting"
            self._started = self._clock()

    def restart_finished(self, ok: bool, error: str = "") -> None:
        """A restart ended; ``ok`` when the new server came up ready.

        Args:
            ok: Whether the new server is up.
            error: What went wrong, if not.
        """
        with self._lock:
            now = self._clock()
            self._failures += 1
            self._last_restart_end = now
            self._last_restart_s = round(now - self._started, 3)
            self._next_attempt = now + self.delay_after(self._failures)
            self._last_error = error
            self._failing_since = None  # the new server gets the full unhealthy_after_s
            if ok:
                self._restarts += 1
                self._state = "ok"
            else:
                self._state = "backoff"

    @property
    def state(self) -> str:
        """One of :data:`STATES`."""
        return self._state

    def snapshot(self) -> dict[str, Any]:
        """What ``status`` shows: state, consecutive failures, restarts, timings.

        Returns:
            ``{"state", "consecutive_failures", "restarts", "last_restart_s",
            "since_last_restart_s", "unready_for_s", "next_attempt_in_s",
            "unhealthy_after_s", "last_error"}`` (times in seconds, ``None`` when
            not applicable).
        """
        with self._lock:
            now = self._clock()
            ended = self._last_restart_end
            failing = self._failing_since
            if self._state == "unready" and failing is not None:
                next_at = max(self._next_attempt, failing + self.unhealthy_after_s)
            elif self._state == "backoff":
                next_at = self._next_attempt
            else:
                next_at = now
            return {
                "state": self._state,
                "consecutive_failures": self._failures,
                "restarts": self._restarts,
                "last_restart_s": self._last_restart_s,
                "since_last_restart_s": None if ended is None else round(now - ended, 3),
                "unready_for_s": 0.0 if failing is None else round(now - failing, 3),
                "next_attempt_in_s": round(max(0.0, next_at - now), 3),
                "unhealthy_after_s": self.unhealthy_after_s,
                "last_error": self._last_error,
            }
