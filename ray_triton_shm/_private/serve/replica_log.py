"""The library's log records in a Serve replica, written where Serve writes its own.

In each replica Serve sets up one logger, ``ray.serve``: the replica's log file
(under the session's ``logs/serve``) and stderr, in Serve's format, at the level of
the deployment's ``logging_config``; Serve asks deployments to log through it. The
library logs under ``ray_triton_shm``, which no one sets up in a replica (Python's
default shows its warnings on stderr, bare, and drops the rest).
:func:`log_through_serve` hands the library's records to Serve's logger, so the
front door's and the node client's lines (the ports taken, connections that ended
with calls open, calls that failed) are in the replica's log, at its level.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "ray_triton_shm"
SERVE_LOGGER = "ray.serve"


class _ThroughServe(logging.Handler):
    """Hands each record to Serve's logger, whose handlers (and their filters) write it."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER).handle(record)


def log_through_serve() -> None:
    """In a Serve replica: the library's records go to Serve's logger, at its level. Idempotent.

    The ``ray_triton_shm`` logger then no longer passes records on to the root
    logger (as Serve's own logger does not): each line is written once.
    """
    package = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(handler, _ThroughServe) for handler in package.handlers):
        package.addHandler(_ThroughServe())
    package.setLevel(logging.getLogger(SERVE_LOGGER).getEffectiveLevel())
    package.propagate = False
