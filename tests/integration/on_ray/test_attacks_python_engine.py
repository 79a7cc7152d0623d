"""The gRPC attacks of ``test_attacks`` against a front door whose gRPC is served by the Python engine.

The shipped app serves gRPC with nghttp2 where it was built (``grpc_engine: auto``); here the
same app with ``grpc_engine: python``, the same legitimate HTTP and gRPC callers throughout and
the same judge and bounds; the HTTP attacks (the same HTTP/1.1 server either way) are skipped.
"""

from __future__ import annotations

import pytest

from tests.helpers import grpc_engine_serving

from . import test_attacks
from .test_attacks import (  # collected here again, with this module's app
    attacked_app,
    test_connections_of_many_unread_calls_hold_no_callers_workers,
    test_frame_floods_stop_no_caller,
    test_idle_and_half_open_connections_lock_no_caller_out,
    test_memory_is_not_sized_by_the_client,
    test_more_slow_clients_than_slots_stop_no_caller,
    test_more_slow_clients_than_the_call_bound_refuse_no_caller,
    test_reset_calls_do_not_run,
    test_slow_or_stalled_clients_hold_no_callers_slots,
)

__all__ = [
    "test_connections_of_many_unread_calls_hold_no_callers_workers",
    "test_frame_floods_stop_no_caller",
    "test_idle_and_half_open_connections_lock_no_caller_out",
    "test_memory_is_not_sized_by_the_client",
    "test_more_slow_clients_than_slots_stop_no_caller",
    "test_more_slow_clients_than_the_call_bound_refuse_no_caller",
    "test_reset_calls_do_not_run",
    "test_slow_or_stalled_clients_hold_no_callers_slots",
]


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """The shipped app with its gRPC served by the Python engine (see ``test_attacks.attacked``)."""
    with attacked_app(tmp_path_factory, {"grpc_engine": "python"}) as where:
        yield where


@pytest.fixture(autouse=True)
def _grpc_attacks_only(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("name", "") if callspec is not None else ""
    if name.startswith("http-"):
        pytest.skip("an HTTP attack: the same HTTP/1.1 server whichever engine serves gRPC")


def test_the_replicas_serve_grpc_with_the_python_engine(attacked) -> None:
    """The attacks here met the Python engine (each engine's GOAWAY says which it is)."""
    servers, _, _ = attacked
    assert grpc_engine_serving(servers.frontdoor.grpc_url) == "python"


def test_after_the_attacks_nothing_is_left(attacked) -> None:
    """Last in this module (see ``test_attacks``)."""
    test_attacks.test_after_the_attacks_nothing_is_left(attacked)
