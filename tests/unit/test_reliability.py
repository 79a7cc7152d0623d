"""Unit checks for the reliability and security pieces: fair leasing, redaction, config defaults."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from tritonclient.utils import InferenceServerException

from ray_triton_shm import OutputTooLargeError, ServerConfig, TritonCallError, UnavailableError
from ray_triton_shm._private.shm import segment
from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm.errors import PoolClosedError


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_waiting_caller_is_served_before_a_newcomer(make_pool, identity_layout: ModelLayout) -> None:
    """A freed slot goes to the caller already waiting, never to one that only just asked."""
    pool = make_pool(identity_layout, slots=1)
    held = pool.acquire(timeout=1)
    got: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: got.setdefault("lease", pool.acquire(timeout=10)))
    waiter.start()
    _wait_for(lambda: len(pool._waiters) == 1)
    held.release()
    assert pool.try_acquire() is None, "a newcomer overtook the waiting caller"
    waiter.join(timeout=5)
    got["lease"].release()  # type: ignore[attr-defined]
    assert pool.stats().free == 1


def test_waiters_are_served_in_order(make_pool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    held = pool.acquire(timeout=1)
    order: list[int] = []

    def wait(i: int) -> None:
        with pool.acquire(timeout=10):
            order.append(i)

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        _wait_for(lambda n=i + 1: len(pool._waiters) == n)
    held.release()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 3]
    assert pool.stats().free == 1


def test_close_wakes_every_waiter_with_pool_closed(make_pool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    held = pool.acquire(timeout=1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(timeout=10)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    _wait_for(lambda: len(pool._waiters) == 3)
    pool.close()
    for t in threads:
        t.join(timeout=5)
    assert len(errors) == 3 and all(isinstance(e, PoolClosedError) for e in errors)
    held.release()


def test_redact_hides_keys_and_region_names() -> None:
    name = segment.new_segment_name("pool")
    text = f"Invalid shared memory region: '/{name}' and region '{name}' of model 'identity'"
    redacted = segment.redact(text)
    assert name not in redacted and "rtshm_" not in redacted
    assert "identity" in redacted and redacted.count("<shm>") == 2


def _grpc_error(message: str, status: str) -> InferenceServerException:
    return InferenceServerException(message, status=f"StatusCode.{status}")


def test_translate_error_types_and_redacts() -> None:
    name = segment.new_segment_name("pool")
    err = translate_error(_grpc_error(f"Unable to find shared memory region: '{name}'", "NOT_FOUND"), "m")
    assert type(err) is TritonCallError and err.status == "NOT_FOUND" and name not in str(err)
    too_small = (
        "shared memory size specified with the request for output 'OUTPUT0' (64 bytes) "
        "should be at least 400 bytes to hold the results"
    )
    err = translate_error(_grpc_error(too_small, "INTERNAL"), "identity")
    assert isinstance(err, OutputTooLargeError) and "max_shapes" in str(err)
    err = translate_error(_grpc_error("This protocol is restricted, expecting header 'x'", "UNAVAILABLE"))
    assert not isinstance(err, UnavailableError) and "shm_api_key" in str(err)


@pytest.mark.parametrize(("text", "expected"), [("", None), ("auto", None), ("true", True), ("0", False)])
def test_protect_shm_api_from_env(monkeypatch: pytest.MonkeyPatch, text: str, expected: bool | None) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_PROTECT_SHM_API", text)
    assert ServerConfig(model_repository="/m").protect_shm_api is expected


_RESTRICTED = ("--grpc-restricted", "--http-restricted")


def test_restricted_flags_carry_the_key_only_when_protected(tmp_path) -> None:
    from ray_triton_shm._private.triton.server_env import LaunchPlan
    from ray_triton_shm._private.triton.server_launch import SHM_API_GRPC_HEADER, SHM_API_HEADER
    from ray_triton_shm.server import TritonServer

    binary = tmp_path / "tritonserver"
    binary.write_text("#!/bin/sh\necho usage\n")
    binary.chmod(0o755)
    plan = LaunchPlan(binary=str(binary), source="explicit")
    open_server = TritonServer(ServerConfig(model_repository=str(tmp_path)))
    assert not [f for f in open_server._command(plan, open_server.config) if f.startswith(_RESTRICTED)]
    keyed = TritonServer(ServerConfig(model_repository=str(tmp_path), protect_shm_api=True))
    flags = [f for f in keyed._command(plan, keyed.config) if f.startswith(_RESTRICTED)]
    assert flags == [
        f"--grpc-restricted-protocol=shared-memory:{SHM_API_HEADER}={keyed.shm_api_key}",
        f"--http-restricted-api=shared-memory:{SHM_API_HEADER}={keyed.shm_api_key}",
    ]
    assert keyed.shm_api_headers == {SHM_API_GRPC_HEADER: keyed.shm_api_key}
    assert TritonServer(ServerConfig(model_repository=str(tmp_path), protect_shm_api=True)).shm_api_key != (
        keyed.shm_api_key
    )


def test_async_waiters_queue_with_threads(make_pool, identity_layout: ModelLayout) -> None:
    pool = make_pool(identity_layout, slots=1)
    held = pool.acquire(timeout=1)
    order: list[str] = []

    def thread_waiter() -> None:
        with pool.acquire(timeout=10):
            order.append("thread")

    async def async_waiter() -> None:
        lease = await pool.acquire_async(timeout=10)
        order.append("async")
        lease.release()

    first = threading.Thread(target=thread_waiter)
    first.start()
    _wait_for(lambda: len(pool._waiters) == 1)
    second = threading.Thread(target=lambda: asyncio.run(async_waiter()))
    second.start()
    _wait_for(lambda: len(pool._waiters) == 2)
    held.release()
    first.join(timeout=10)
    second.join(timeout=10)
    assert order == ["thread", "async"]
    assert pool.stats().free == 1 and not pool._waiters


def test_a_zombie_owns_nothing() -> None:
    """Segments and grants of an exited but unreaped process count as ownerless."""
    import subprocess

    child = subprocess.Popen(["true"])
    try:

        def is_zombie() -> bool:
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"

        _wait_for(is_zombie)
        assert segment.process_start_time(child.pid) is None
        assert segment.process_start_time(os.getpid()) is not None
    finally:
        child.wait()
