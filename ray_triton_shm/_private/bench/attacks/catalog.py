"""An attack: its name, class, protocol and function; the attacks of every class, in table order."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_triton_shm._private.bench.attacks.wire import Target

CLASSES = ("stalled", "memory", "connections", "reset/floods", "protocol")


@dataclass(frozen=True, kw_only=True)
class Attack:
    """One bounded attack.

    Attributes:
        name: Its row in the table.
        kind: Its class (one of :data:`CLASSES`).
        protocol: ``http`` or ``grpc``: the port it goes to.
        run: ``run(target, until, scale) -> notes``: attacks ``target`` until the monotonic
            time ``until`` (holding what it opened), lets go of everything, and returns
            what it saw (counts, the server's answer). ``scale`` multiplies its counts.
        summary: What it does, in a few words.
    """

    name: str
    kind: str
    protocol: str
    run: Callable[[Target, float, float], dict[str, Any]]
    summary: str


def hold(until: float, step: float = 0.1) -> None:
    """Sleep until the monotonic time ``until``."""
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(step, left))


def count(n: int, scale: float) -> int:
    """``n`` scaled, at least 1."""
    return max(1, round(n * scale))
