"""How long an HTTP/1.1 client may take: the limits, and the clocks that hold reads to them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray_triton_shm._private.serve.http1.head import HttpTimeoutError
from ray_triton_shm.errors import ConfigError

HEAD_TIMEOUT_S = 60.0
"""Time a request's line and headers may take from their first byte (nginx's ``client_header_timeout``)."""


IDLE_TIMEOUT_S = 60.0
"""Time a connection may wait for its next request (nghttpx's ``--frontend-keep-alive-timeout``)."""


BODY_GRACE_S = 20.0
"""Time before :data:`BODY_MIN_RATE` applies, and most silence (Apache's ``RequestReadTimeout body=20``)."""


BODY_MIN_RATE = 500.0
"""Bytes a second a body must average after its grace time (Apache's ``RequestReadTimeout MinRate=500``)."""


SEND_TIMEOUT_S = 60.0
"""Time an answer may take to be written (nginx's ``send_timeout``, here for the whole answer)."""


@dataclass(frozen=True, kw_only=True)
class HttpTimeouts:
    """How long a client may take, per connection (defaults: the module's constants).

    Attributes:
        head_s: A request's line and headers must arrive within this, from their
            first byte: a total deadline, not one per read (else 408 and close).
        idle_s: A kept-alive connection with no request for this long is closed.
        body_grace_s: A body may take this long before ``body_min_rate`` applies;
            it is also the longest a body may go without a byte (else 408 and close).
        body_min_rate: Bytes a second a body must average once ``body_grace_s`` is past.
            Both count only the time the server waits for the client's bytes.
        send_s: An answer not written within this (a client that reads nothing)
            ends its connection.

    Raises:
        ConfigError: A value that is not a finite number > 0.
    """

    head_s: float = HEAD_TIMEOUT_S
    idle_s: float = IDLE_TIMEOUT_S
    body_grace_s: float = BODY_GRACE_S
    body_min_rate: float = BODY_MIN_RATE
    send_s: float = SEND_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("head_s", "idle_s", "body_grace_s", "body_min_rate", "send_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"HttpTimeouts.{name} must be a number > 0, got {value!r}")


class ConnectionGone(Exception):
    """The peer closed the connection, took too long to read an answer, or the server is closing it."""


class Deadline:
    """A read clock with one fixed deadline (a request head's, an idle connection's).

    Args:
        seconds: From now.
        late: The error when it passes.
    """

    def __init__(self, seconds: float, late: Callable[[], Exception]) -> None:
        self._at = time.monotonic() + seconds
        self.late = late

    def left(self) -> float:
        """Seconds until the deadline."""
        return self._at - time.monotonic()

    def spent(self, seconds: float, n: int) -> None:
        """A read waited ``seconds`` and got ``n`` bytes (nothing changes: the deadline is fixed)."""


class BodyClock:
    """A body's read clock: ``grace_s`` at first and between bytes, then ``min_rate`` bytes/s on average.

    It counts only the time the server waits for the client (in ``recv``):
    time the server spends on its own between reads (waiting for a slot,
    say) is not the client's.
    """

    def __init__(self, grace_s: float, min_rate: float) -> None:
        self._grace_s = grace_s
        self._min_rate = min_rate
        self._waited = 0.0  # in all
        self._silent = 0.0  # since the last byte
        self._received = 0

    def left(self) -> float:
        """Seconds the next read may wait."""
        rate_left = self._grace_s + self._received / self._min_rate - self._waited
        return min(self._grace_s - self._silent, rate_left)

    def spent(self, seconds: float, n: int) -> None:
        """A read waited ``seconds`` and got ``n`` bytes."""
        self._waited += seconds
        self._silent = 0.0 if n else self._silent + seconds
        self._received += n

    def late(self) -> Exception:
        """The error of a body that came too slowly."""
        return HttpTimeoutError(
            f"request body arrived too slowly (no byte for {self._grace_s:g} s, or under "
            f"{self._min_rate:g} bytes/s after {self._grace_s:g} s)"
        )
