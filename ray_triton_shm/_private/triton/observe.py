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
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

__all__ = ["NULL_OBSERVER", "NullObserver", "Observer", "safely"]


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


def safely(call: Callable[..., object], *args: object) -> None:
    """Call an observer method; an observer failure is logged, never raised into the data path."""
    try:
        call(*args)
    except Exception:
        logger.debug("observer %r failed", call, exc_info=True)
