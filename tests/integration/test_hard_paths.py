"""The hardest paths of a direct client, for real: Triton dying under several
leases, a client closed while another thread is inside ``infer()``, and a
zero-copy view that outlives its client (docs/reliability.md, cases 12 to 14).

Each test starts its own server or client, checks every answer value by value,
and checks what is left afterwards: slots, segments, regions in Triton.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ray_triton_shm import (
    PoolClosedError,
    PoolConfig,
    RayTritonShmError,
    ServerConfig,
    TritonServer,
    TritonShmClient,
    UnavailableError,
)
from ray_triton_shm._private.shm import segment

from .conftest import MODEL_REPOSITORY, close_and_check, transport_overrides
from .conftest import registered_regions as regions

SLEEP_S = 2.5


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def affine(x: np.ndarray) -> np.ndarray:
    return (np.float32(1) - np.float32(2) * x).astype(np.float32)


@pytest.fixture(scope="module")
def own_server() -> Iterator[TritonServer]:
    """A server of this module's own: one test kills it."""
    server = TritonServer(
        ServerConfig(model_repository=str(MODEL_REPOSITORY), load_models=("affine", "sleep"))
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _call_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# -- case 12: Triton killed while several requests hold leases ---------------------------


def test_triton_killed_while_requests_hold_leases(own_server: TritonServer, shm_transport: str) -> None:
    pools = {"sleep": PoolConfig(slots=4, lease_timeout_s=30)}
    overrides = transport_overrides(own_server, shm_transport)
    client = TritonShmClient(**overrides, pools=pools, request_timeout_s=60)
    try:
        client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
        pool = client.pool("sleep")
        region = pool.region_name
        calls = [
            _call_in_thread(
                lambda i=i: client.infer("sleep", {"INPUT0": np.full((1, 1), SLEEP_S + i / 1000, np.float32)})
            )
            for i in range(4)
        ]
        wait_for(lambda: pool.stats().busy == 4, what="four leases held")
        pid = own_server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for thread, _ in calls:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a request hung after Triton died"
        for _, box in calls:
            # Each ends with one of our typed errors, or (had it finished first) its own answer.
            if "error" in box:
                assert isinstance(box["error"], RayTritonShmError), repr(box["error"])
        assert sum("error" in box for _, box in calls) >= 1
        stats = pool.stats()
        assert stats.busy == 0 and stats.pinned == 0, stats
        assert stats.free + stats.quarantined == 4, stats
        wait_for(lambda: not own_server.is_alive(), what="the killed Triton to be gone")

        own_server.restart()
        assert region not in regions(own_server.grpc_url)
        # Give quarantined slots (a request that may still run) no chance to be handed out
        # early: only the free ones serve now, and they answer correctly.
        free_now = pool.stats().free
        assert free_now >= 1
        again = [
            _call_in_thread(
                lambda i=i: client.infer("sleep", {"INPUT0": np.full((1, 1), 0.2 + i / 1000, np.float32)})
            )
            for i in range(free_now)
        ]
        for i, (thread, box) in enumerate(again):
            thread.join(timeout=60)
            assert "error" not in box, repr(box.get("error"))
            np.testing.assert_allclose(box["result"]["OUTPUT0"], [[0.2 + i / 1000]], rtol=1e-6)
            assert box["result"].path == "shm"
        assert region in regions(own_server.grpc_url), "the region was not registered again"
        assert pool.stats().busy == 0
    finally:
        client.close()
    assert region not in regions(own_server.grpc_url)
    assert not os.path.exists(os.path.join(segment.SHM_DIR, region))


def test_first_requests_after_a_restart_are_answered(own_server: TritonServer, shm_transport: str) -> None:
    """Requests that failed while Triton was down leave the client's gRPC channel reconnecting
    with backoff (1 s, 1.6 s, 2.6 s, ...), failing every call at once meanwhile; the first
    requests once the restarted Triton is ready must be answered all the same, through shm
    (region registered again) and over plain gRPC."""
    pools = {"sleep": PoolConfig(slots=1, lease_timeout_s=30)}
    client = TritonShmClient(
        **transport_overrides(own_server, shm_transport), pools=pools, request_timeout_s=60
    )
    try:
        client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
        region = client.pool("sleep").region_name
        pid = own_server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not own_server.is_alive(), what="the killed Triton to be gone")
        # Both paths fail while it is down (each with our typed error), and each try
        # makes the gRPC channel attempt a connection that is refused.
        with pytest.raises(UnavailableError):
            client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
        with pytest.raises(UnavailableError):
            client.infer_grpc("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
        time.sleep(2.0)  # down a while: the channel's backoff grows past the restart's length
        assert client.pool("sleep").stats().free == 1

        own_server.restart()
        over_shm = client.infer("sleep", {"INPUT0": np.full((1, 1), 0.01, np.float32)})
        np.testing.assert_allclose(over_shm["OUTPUT0"], [[0.01]], rtol=1e-6)
        assert over_shm.path == "shm"
        assert region in regions(own_server.grpc_url), "the region was not registered again"
        over_grpc = client.infer_grpc("sleep", {"INPUT0": np.full((1, 1), 0.02, np.float32)})
        np.testing.assert_allclose(over_grpc["OUTPUT0"], [[0.02]], rtol=1e-6)
        assert over_grpc.path == "grpc"
    finally:
        close_and_check(client)
    assert not os.path.exists(os.path.join(segment.SHM_DIR, region))


# -- case 13: close() while another thread is inside infer() -----------------------------


@pytest.mark.parametrize("phase", ["at_triton", "waiting_for_a_slot"])
def test_close_while_another_thread_is_inside_infer(
    triton_server: TritonServer, shm_transport: str, phase: str
) -> None:
    pools = {"sleep": PoolConfig(slots=1, lease_timeout_s=30)}
    client = TritonShmClient(**transport_overrides(triton_server, shm_transport), pools=pools)
    client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
    pool = client.pool("sleep")
    region = pool.region_name
    calls = [_call_in_thread(lambda: client.infer("sleep", {"INPUT0": np.full((1, 1), 1.5, np.float32)}))]
    wait_for(lambda: pool.stats().busy == 1, what="the first request's lease")
    if phase == "waiting_for_a_slot":
        calls.append(_call_in_thread(lambda: client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})))
        wait_for(lambda: len(pool._waiters) == 1, what="the second request waiting for a slot")
    client.close()
    for (thread, box), sent in zip(calls, (1.5, 0.0)):
        thread.join(timeout=30)
        assert not thread.is_alive(), "a request hung after close()"
        if "error" in box:
            # Typed, and nothing else: not a KeyError from a cleared slot, not grpc's ValueError.
            assert isinstance(box["error"], RayTritonShmError), repr(box["error"])
        else:
            np.testing.assert_allclose(box["result"]["OUTPUT0"], [[sent]])
    if phase == "waiting_for_a_slot":
        # Once close() has begun no request starts, even one that gets the slot it waited for.
        assert isinstance(calls[1][1].get("error"), PoolClosedError), calls[1][1]
    with pytest.raises(PoolClosedError):
        client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
    assert not os.path.exists(os.path.join(segment.SHM_DIR, region)), "the segment survived close()"
    wait_for(lambda: region not in regions(triton_server.grpc_url), what="the region to leave Triton")


# -- case 14: a zero-copy view outliving its client ----------------------------------------


def test_view_outliving_its_client_keeps_its_values(triton_server: TritonServer, shm_transport: str) -> None:
    shapes = {"INPUT0": (4096,), "OUTPUT0": (4096,)}
    pools = {"affine": PoolConfig(slots=1, max_batch_size=1, max_shapes=shapes)}
    client = TritonShmClient(**transport_overrides(triton_server, shm_transport), pools=pools)
    x = np.random.default_rng(31).standard_normal((1, 4096), dtype=np.float32)
    result = client.infer("affine", {"INPUT0": x}, copy=False)
    view = result["OUTPUT0"]
    region = client.pool("affine").region_name
    assert not view.flags.owndata
    close_and_check(client, allow_pinned=True)
    # The name is gone and Triton has let go; the view still reads its own answer.
    assert not os.path.exists(os.path.join(segment.SHM_DIR, region))
    assert region not in regions(triton_server.grpc_url)
    np.testing.assert_array_equal(view, affine(x))
    # Another client's traffic cannot reach it either.
    with TritonShmClient(**transport_overrides(triton_server, shm_transport), pools=pools) as other:
        other.infer("affine", {"INPUT0": np.zeros((1, 4096), np.float32)}, copy=False)
    np.testing.assert_array_equal(view, affine(x))
    assert float(view.sum()) == pytest.approx(float(affine(x).sum()), rel=1e-5)
    del result, view
    gc.collect()
