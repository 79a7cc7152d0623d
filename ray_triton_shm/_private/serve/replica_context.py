"""What a replica reads of its deployment's settings from Serve's replica context.

Serve's replica context has no public field for the deployment's settings: these
read its private ``_deployment_config``. A Serve without it leaves the door's calls
unbounded (Serve still bounds its own; ``test_real_peers`` catches it), the access
log on, and the drain at the front door's own ``drain_timeout_s``.
"""

from __future__ import annotations

from typing import Any

from ray_triton_shm._private.serve.door.frontdoor import CLOSE_S


def _setting(context: Any, name: str) -> Any:
    """The deployment's setting ``name`` in Serve's replica context (``None`` where it does not say)."""
    return getattr(getattr(context, "_deployment_config", None), name, None)


def max_ongoing_requests(context: Any) -> int | None:
    """The deployment's ``max_ongoing_requests`` (``None`` where Serve's context does not say)."""
    value = _setting(context, "max_ongoing_requests")
    return value if isinstance(value, int) and value > 0 else None


def access_log_enabled(context: Any) -> bool:
    """Whether the deployment's ``logging_config`` keeps access logs on (Serve's default: on)."""
    logging_config = _setting(context, "logging_config") or {}
    if not isinstance(logging_config, dict):
        logging_config = getattr(logging_config, "dict", lambda: {})()
    return bool(logging_config.get("enable_access_log", True))


def _seconds(context: Any, name: str) -> float | None:
    """The deployment's setting ``name``, in seconds (``None`` where Serve's context does not say)."""
    value = _setting(context, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return float(value)


def drain_budget(context: Any, drain_timeout_s: float, reserved_s: float) -> float:
    """How long the front door's drain may take when the replica stops.

    Serve's controller kills a stopping replica ``graceful_shutdown_timeout_s``
    after it asked it to stop. Before the replica's own stop runs, Serve waits at
    least one ``graceful_shutdown_wait_loop_s`` for its own requests. The drain
    gets its ``drain_timeout_s`` where that fits, else what is left of Serve's
    time after that wait, ``reserved_s`` (the replica's own steps before the
    drain) and the door's close (``CLOSE_S``): a call the drain cuts then ends
    with its connection closed by the replica, its slot back in the pool, rather
    than with the process killed under it.

    Args:
        context: Serve's replica context (or ``None``).
        drain_timeout_s: The front door's ``drain_timeout_s``.
        reserved_s: What the replica's stop spends before the drain.
    """
    graceful_s = _seconds(context, "graceful_shutdown_timeout_s")
    if graceful_s is None:
        return drain_timeout_s
    wait_loop_s = _seconds(context, "graceful_shutdown_wait_loop_s") or 0.0
    return max(0.0, min(drain_timeout_s, graceful_s - wait_loop_s - reserved_s - CLOSE_S))
