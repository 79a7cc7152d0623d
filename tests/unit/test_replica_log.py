"""The library's log records in a Serve replica go through Serve's logger (logging only, no Ray)."""

from __future__ import annotations

import logging

import pytest

from ray_triton_shm._private.serve.replica_log import PACKAGE_LOGGER, SERVE_LOGGER, log_through_serve


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    """Serve's logger as a replica has it (its own handler, INFO, not propagating); both restored after."""
    serve, package = logging.getLogger(SERVE_LOGGER), logging.getLogger(PACKAGE_LOGGER)
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in (serve, package)]
    kept = _Kept()
    serve.handlers = [kept]
    serve.setLevel(logging.INFO)
    serve.propagate = False
    try:
        yield kept
    finally:
        for lg, level, propagate, handlers in saved:
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers = handlers


def test_the_librarys_lines_reach_serves_handlers_once_at_serves_level(loggers) -> None:
    log_through_serve()
    log_through_serve()  # idempotent: one handler, each line written once
    module = logging.getLogger(f"{PACKAGE_LOGGER}._private.serve.door.frontdoor")
    module.info("front door on %s", "127.0.0.1")
    module.debug("not at Serve's level")
    module.warning("calls still running")
    assert loggers.messages == ["front door on 127.0.0.1", "calls still running"]
    assert not logging.getLogger(PACKAGE_LOGGER).propagate  # not written again by the root's handlers
