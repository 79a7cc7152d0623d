"""A small callback interface through which the core reports what it does.

The core (client, pools) must not import Ray, yet the Ray layer wants
Prometheus metrics and per-node traffic counters. So the client calls an
:class:`Observer`; the default one does nothing, and the Ray layer passes one
that feeds ``ray.util.metrics`` (see ``ray_triton_shm._private.node.metrics``).

Observers are called on the request path: they must be cheap and must not
raise (the client shields itself from a failing observer anyway).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

__all__ = ["NULL_OBSERVER", "EventBatch", "EventSums", "NullObserver", "Observer", "safely"]


class Observer(Protocol):
    """Receives events from a client."""

    def request(self, model: str, path: str, nbytes: int, seconds: float) -> None:
        """One request Triton answered.

        Args:
            model: Model name.
            path: How the tensors travelled: ``"shm"``, ``"cuda_shm"`` or ``"grpc"``.
            nbytes: Input plus output bytes of the request.
            seconds: Time from sending the request to having its answer.
        """

    def lease_wait(self, model: str, seconds: float) -> None:
        """A slot of ``model`` was leased after waiting ``seconds``."""

    def error(self, model: str, kind: str) -> None:
        """A call on ``model`` failed with an error of type name ``kind``."""


class NullObserver:
    """The default: ignores every event."""

    def request(self, model: str, path: str, nbytes: int, seconds: float) -> None:
        pass

    def lease_wait(self, model: str, seconds: float) -> None:
        pass

    def error(self, model: str, kind: str) -> None:
        pass


NULL_OBSERVER = NullObserver()

_REQUEST, _LEASE_WAIT, _ERROR = 0, 1, 2


@dataclass
class EventSums:
    """What an :class:`EventBatch` gathered since it was last drained.

    Attributes:
        requests: ``(model, path)`` -> ``[requests, bytes]``.
        request_seconds: ``(model, path)`` -> each request's seconds, in order.
        lease_waits: ``model`` -> each lease's wait in seconds, in order.
        errors: ``(model, error type name)`` -> count.
    """

    requests: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    request_seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    lease_waits: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.requests or self.lease_waits or self.errors)


class EventBatch:
    """An :class:`Observer` that only queues its events, for a reader to drain in sums.

    Recording an event is one ``deque.append`` (atomic, no lock): request
    threads never wait for each other or for the reader. :meth:`drain` may
    run in any thread, several at once: each event is taken by exactly one
    of them.
    """

    def __init__(self) -> None:
        self._events: deque[tuple] = deque()

    def request(self, model: str, path: str, nbytes: int, seconds: float) -> None:
        self._events.append((_REQUEST, model, path, nbytes, seconds))

    def lease_wait(self, model: str, seconds: float) -> None:
        self._events.append((_LEASE_WAIT, model, seconds))

    def error(self, model: str, kind: str) -> None:
        self._events.append((_ERROR, model, kind))

    def queued(self) -> int:
        """How many events wait to be drained."""
        return len(self._events)

    def drain(self) -> EventSums:
        """Take every event queued so far, added up."""
        sums = EventSums()
        pop = self._events.popleft
        while True:
            try:
                event = pop()
            except IndexError:
                return sums
            if event[0] == _REQUEST:
                _, model, path, nbytes, seconds = event
                entry = sums.requests.get((model, path))
                if entry is None:
                    entry = sums.requests[(model, path)] = [0, 0]
                    sums.request_seconds[(model, path)] = []
                entry[0] += 1
                entry[1] += nbytes
                sums.request_seconds[(model, path)].append(seconds)
            elif event[0] == _LEASE_WAIT:
                sums.lease_waits.setdefault(event[1], []).append(event[2])
            else:
                key = (event[1], event[2])
                sums.errors[key] = sums.errors.get(key, 0) + 1


def safely(call: Callable[..., object], *args: object) -> None:
    """Call an observer method; an observer failure is logged, never raised into the data path."""
    try:
        call(*args)
    except Exception:
        logger.debug("observer %r failed", call, exc_info=True)
