"""TritonShmClient against a real Triton: the example models through shared memory, errors, concurrency."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ray_triton_shm import (
    InputError,
    LeaseReleasedError,
    PoolClosedError,
    PoolConfig,
    PoolTimeoutError,
    TritonCallError,
    TritonServer,
    TritonShmClient,
    UnavailableError,
)
from tests.helpers import wait_for

from .conftest import close_and_check

SHM_DIR = "/dev/shm"


# -- helpers ---------------------------------------------------------------
def add_sub_inputs(seed: int, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "INPUT0": rng.integers(-(10**6), 10**6, size=(batch, 16), dtype=np.int32),
        "INPUT1": rng.integers(-(10**6), 10**6, size=(batch, 16), dtype=np.int32),
    }


def add_sub_expected(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"OUTPUT0": inputs["INPUT0"] + inputs["INPUT1"], "OUTPUT1": inputs["INPUT0"] - inputs["INPUT1"]}


def multi_io_inputs(seed: int, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "INPUT0": rng.random((batch, 3, 224, 224), dtype=np.float32),
        "INPUT1": rng.integers(-1000, 1000, size=(batch, 10), dtype=np.int32),
    }


def multi_io_expected(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    batch = inputs["INPUT0"].shape[0]
    return {
        "OUTPUT0": inputs["INPUT0"].reshape(batch, 512, 294).sum(-1, dtype=np.float32),
        "OUTPUT1": inputs["INPUT1"].reshape(batch, 5, 2).sum(-1, dtype=np.int32),
    }


def assert_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], expected, err_msg=name)


def server_regions(url: str) -> set[str]:
    """Names of the system shared-memory regions the server has registered."""
    with grpcclient.InferenceServerClient(url) as admin:
        return set(admin.get_system_shared_memory_status(as_json=True).get("regions", {}))


def shm_names() -> set[str]:
    return set(os.listdir(SHM_DIR))


def assert_all_free(client: TritonShmClient, model: str) -> None:
    stats = client.pool(model).stats()
    assert (stats.free, stats.busy, stats.pinned, stats.quarantined) == (stats.slots, 0, 0, 0), stats


# -- round trips -------------------------------------------------------------
def test_add_sub_round_trip(client: TritonShmClient) -> None:
    inputs = add_sub_inputs(1, 5)
    result = client.infer("add_sub", inputs)
    assert result.path == "shm"
    assert_outputs(result, add_sub_expected(inputs))
    only = client.infer("add_sub", inputs, outputs=["OUTPUT1"])
    assert_outputs(only, {"OUTPUT1": add_sub_expected(inputs)["OUTPUT1"]})
    assert_all_free(client, "add_sub")


def test_multi_io_round_trip(client: TritonShmClient) -> None:
    inputs = multi_io_inputs(2, 3)
    result = client.infer("multi_io", inputs)
    assert result.path == "shm"
    assert_outputs(result, multi_io_expected(inputs))


def test_scale_nobatch_round_trip(client: TritonShmClient) -> None:
    x = np.random.default_rng(3).standard_normal((4, 4))
    result = client.infer("scale_nobatch", {"INPUT0": x})
    assert result.path == "shm"
    assert client.layout("scale_nobatch").batched is False
    assert_outputs(result, {"OUTPUT0": 2 * x})


def affine(x: np.ndarray) -> np.ndarray:
    """What the ``affine`` model answers: an output that differs from its input everywhere."""
    return (np.float32(1) - np.float32(2) * x).astype(np.float32)


def test_variable_lengths_in_one_slot(client: TritonShmClient) -> None:
    longest = client.layout("affine").inputs[0].max_dims[0]
    rng = np.random.default_rng(4)
    # Long first, then shorter: a short answer must not carry the tail of a longer one,
    # and (the model's output differs from its input) must not be read from the input region.
    for shape in [(1, longest), (2, 777), (1, 3), (2, longest // 2), (1, 1)]:
        x = rng.standard_normal(shape, dtype=np.float32)
        result = client.infer("affine", {"INPUT0": x})
        assert result.path == "shm"
        assert_outputs(result, {"OUTPUT0": affine(x)})
    assert client.pool("affine").stats().slots == 2


def test_whoami_is_answered_by_our_server(client: TritonShmClient, triton_server: TritonServer) -> None:
    x = np.arange(2 * 10, dtype=np.float32).reshape(2, 10)
    result = client.infer("whoami", {"INPUT0": x})
    assert result.path == "shm"
    assert_outputs(result, {"OUTPUT0": x, "SERVER_PID": np.full((2, 1), triton_server.pid, np.int64)})


def test_min_shm_bytes_sends_small_requests_over_grpc(make_client) -> None:
    client = make_client(pools={"add_sub": PoolConfig(min_shm_bytes=1000)})
    small = add_sub_inputs(5, 2)  # 256 bytes
    result = client.infer("add_sub", small)
    assert result.path == "grpc"
    assert_outputs(result, add_sub_expected(small))
    large = add_sub_inputs(6, 8)  # 1024 bytes
    result = client.infer("add_sub", large)
    assert result.path == "shm"
    assert_outputs(result, add_sub_expected(large))


@pytest.mark.parametrize(
    ("model", "make_inputs"),
    [
        ("add_sub", lambda: add_sub_inputs(7, 4)),
        ("multi_io", lambda: multi_io_inputs(8, 2)),
        ("scale_nobatch", lambda: {"INPUT0": np.random.default_rng(9).standard_normal((4, 4))}),
    ],
)
def test_infer_grpc_gives_the_same_outputs(client: TritonShmClient, model: str, make_inputs) -> None:
    inputs = make_inputs()
    over_shm = client.infer(model, inputs)
    over_grpc = client.infer_grpc(model, inputs)
    assert (over_shm.path, over_grpc.path) == ("shm", "grpc")
    assert_outputs(over_grpc, dict(over_shm))


def test_batch_larger_than_a_slot_is_split_and_reassembled_in_order(make_client) -> None:
    client = make_client(pools={"add_sub": PoolConfig(slots=2)})
    assert client.layout("add_sub").batch_capacity == 8
    # Rows differ from each other, so any reordering of chunks shows.
    inputs = {
        "INPUT0": np.arange(20 * 16, dtype=np.int32).reshape(20, 16),
        "INPUT1": (np.arange(20, dtype=np.int32)[:, None] * 1000 + np.arange(16, dtype=np.int32)),
    }
    result = client.infer("add_sub", inputs)
    assert result.path == "shm"
    assert_outputs(result, add_sub_expected(inputs))
    assert_all_free(client, "add_sub")


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_large_tensors_copied_by_several_threads_arrive_whole(make_client, copy_threads: int) -> None:
    n = 5 * 1024 * 1024 + 3  # 20 MB and a ragged tail: split into parts of unequal length
    pool = PoolConfig(slots=1, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    client = make_client(copy_threads=copy_threads, pools={"affine": pool})
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, n), dtype=np.float32)
        result = client.infer("affine", {"INPUT0": x})
        assert result.path == "shm"
        assert_outputs(result, {"OUTPUT0": affine(x)})
        assert result["OUTPUT0"].flags.writeable and result["OUTPUT0"].base is None  # a copy, the slot's free
    helpers = [t for t in threading.enumerate() if t.name.startswith("rtshm-copy")]
    assert (len(helpers) > 0) == (copy_threads > 1)
    client.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("rtshm-copy")]


# -- bad inputs --------------------------------------------------------------
def _good() -> dict[str, np.ndarray]:
    return add_sub_inputs(10, 2)


BAD_INPUTS: dict[str, tuple[str, Callable[[int], dict[str, Any]], str]] = {
    # case: (model, inputs given identity's longest length, message must match)
    "unknown name": ("add_sub", lambda n: {**_good(), "INPUT2": _good()["INPUT0"]}, r"unknown: .'INPUT2'"),
    "missing name": ("add_sub", lambda n: {"INPUT0": _good()["INPUT0"]}, r"missing: .'INPUT1'"),
    "wrong dtype": (
        "add_sub",
        lambda n: {**_good(), "INPUT0": _good()["INPUT0"].astype(np.float32)},
        "INPUT0: expected dtype INT32",
    ),
    "wrong rank": (
        "add_sub",
        lambda n: {**_good(), "INPUT1": _good()["INPUT1"][0]},
        "INPUT1: expected rank 2",
    ),
    "wrong fixed dim": (
        "add_sub",
        lambda n: {**_good(), "INPUT0": _good()["INPUT0"][:, :15]},
        r"INPUT0: shape .2, 15. does not match",
    ),
    "batch sizes differ": (
        "add_sub",
        lambda n: {**_good(), "INPUT1": _good()["INPUT1"][:1]},
        "different batch sizes",
    ),
    "too big for the slot": (
        "identity",
        lambda n: {"INPUT0": np.zeros((1, n + 1), np.float32)},
        "too big for a slot",
    ),
    "string array": (
        "add_sub",
        lambda n: {**_good(), "INPUT0": np.full((2, 16), "7")},
        r"INPUT0: <U1 .BYTES/string",
    ),
    "object array": (
        "add_sub",
        lambda n: {**_good(), "INPUT0": np.full((2, 16), b"7", dtype=object)},
        r"INPUT0: object .BYTES/string",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_input_error_and_free_every_slot(client: TritonShmClient, case: str) -> None:
    model, make_bad, message = BAD_INPUTS[case]
    longest = client.layout("identity").inputs[0].max_dims[0]
    good = _good() if model == "add_sub" else {"INPUT0": np.ones((1, 8), np.float32)}
    want = add_sub_expected(good) if model == "add_sub" else {"OUTPUT0": good["INPUT0"]}
    assert_outputs(client.infer(model, good), want)  # the pool exists before the bad call
    with pytest.raises(InputError, match=message):
        client.infer(model, make_bad(longest))
    assert_all_free(client, model)
    assert_outputs(client.infer(model, good), want)


def test_unknown_output_name_raises_input_error(client: TritonShmClient) -> None:
    with pytest.raises(InputError, match=r"unknown: .'NOPE'"):
        client.infer("add_sub", _good(), outputs=["OUTPUT0", "NOPE"])
    assert_outputs(client.infer("add_sub", _good()), add_sub_expected(_good()))
    assert_all_free(client, "add_sub")


def test_non_contiguous_inputs_give_correct_outputs(client: TritonShmClient) -> None:
    rng = np.random.default_rng(11)
    a = rng.integers(-100, 100, size=(16, 6), dtype=np.int32).T  # transposed: (6, 16), F-ordered
    b = rng.integers(-100, 100, size=(6, 32), dtype=np.int32)[:, ::2]  # strided columns
    assert not a.flags.c_contiguous and not b.flags.c_contiguous
    result = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
    assert_outputs(result, {"OUTPUT0": a + b, "OUTPUT1": a - b})
    x = rng.standard_normal((4, 3000), dtype=np.float32)[::2, ::3]  # (2, 1000), strided both ways
    assert not x.flags.c_contiguous
    assert_outputs(client.infer("identity", {"INPUT0": x}), {"OUTPUT0": np.ascontiguousarray(x)})


# -- server-side errors and back-pressure -----------------------------------
def test_server_error_raises_triton_call_error_and_returns_the_slot(make_client) -> None:
    client = make_client(pools={"always_fails": PoolConfig(slots=1)})
    x = np.ones((2, 4), np.float32)
    for _ in range(3):  # with one slot, a slot kept after an error would make the next call time out
        with pytest.raises(TritonCallError, match="always_fails refuses by design") as info:
            client.infer("always_fails", {"INPUT0": x}, timeout=1.0)
        assert not isinstance(info.value, UnavailableError)
        assert info.value.model == "always_fails"
        assert_all_free(client, "always_fails")


def test_pool_exhaustion_raises_pool_timeout(client: TritonShmClient) -> None:
    pool = client.pool("sleep")
    assert pool.stats().slots == 1
    held = np.full((1, 1), 1.5, np.float32)
    outcome: dict[str, Any] = {}

    def hold_the_slot() -> None:
        try:
            outcome["result"] = client.infer("sleep", {"INPUT0": held})
        except BaseException as e:
            outcome["error"] = e

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        assert wait_for(lambda: pool.stats().busy == 1, 30), "the holder never got the slot"
        started = time.monotonic()
        with pytest.raises(PoolTimeoutError) as info:
            client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)}, timeout=0.3)
        waited = time.monotonic() - started
    finally:
        holder.join(15)
    assert 0.25 <= waited < 10, waited  # never before its timeout; slack for a loaded machine
    assert (info.value.model, info.value.timeout_s) == ("sleep", 0.3)
    assert "error" not in outcome, outcome.get("error")
    assert_outputs(outcome["result"], {"OUTPUT0": held})
    assert_all_free(client, "sleep")


def test_concurrent_threads_each_get_their_own_answer(client: TritonShmClient) -> None:
    failures: list[str] = []

    def caller(thread: int) -> None:
        try:
            for i in range(20):
                inputs = add_sub_inputs(1000 * thread + i, 1 + (thread + i) % 8)
                result = client.infer("add_sub", inputs)
                assert_outputs(result, add_sub_expected(inputs))
        except BaseException as e:
            failures.append(f"thread {thread}: {e!r}")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    assert_all_free(client, "add_sub")


def _process_worker(url: str, seed: int, results: Any) -> None:
    """Runs in a spawned process: its own client, its own pool, ten add_sub calls."""
    try:
        with TritonShmClient(url=url) as client:
            outputs = []
            for i in range(10):
                result = client.infer("add_sub", add_sub_inputs(seed * 100 + i, 1 + i % 8))
                outputs.append((result.path, dict(result)))
            region = client.pool("add_sub").region_name
        results.put((seed, os.getpid(), region, outputs, None))
    except BaseException as e:
        results.put((seed, os.getpid(), None, None, repr(e)))


@pytest.mark.slow
def test_several_processes_share_one_server(triton_server: TritonServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(triton_server.grpc_url, s, results)) for s in range(3)]
    for p in procs:
        p.start()
    try:
        answers = [results.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert all(error is None for *_, error in answers), answers
    assert len({pid for _, pid, *_ in answers}) == 3
    regions = {region for _, _, region, *_ in answers}
    assert len(regions) == 3
    for seed, _, _, outputs, _ in answers:
        for i, (path, got) in enumerate(outputs):
            assert path == "shm"
            assert_outputs(got, add_sub_expected(add_sub_inputs(seed * 100 + i, 1 + i % 8)))
    assert not regions & shm_names(), "a process left its segment behind"
    assert not regions & server_regions(triton_server.grpc_url), "a region stayed registered"


# -- zero copy ---------------------------------------------------------------
def test_infer_views_are_read_only_and_a_kept_view_pins_its_slot(client: TritonShmClient) -> None:
    x = np.random.default_rng(12).standard_normal((2, 4096), dtype=np.float32)
    pool = client.pool("affine")
    slots = pool.stats().slots
    with client.infer_views("affine", {"INPUT0": x}) as views:
        out = views["OUTPUT0"]
        np.testing.assert_array_equal(out, affine(x))
        assert not out.flags.writeable and not out.flags.owndata
        with pytest.raises(ValueError):
            out[0, 0] = 1.0
        assert pool.stats().busy == 1
        kept = out
    del views, out
    stats = pool.stats()
    assert (stats.pinned, stats.busy, stats.free) == (1, 0, slots - 1), stats
    # While the view lives its slot is not handed out, and its data stays intact.
    others = [pool.try_acquire() for _ in range(slots - 1)]
    assert all(lease is not None for lease in others)
    assert pool.try_acquire() is None
    for lease in others:
        lease.release()
    np.testing.assert_array_equal(kept, affine(x))
    del kept
    gc.collect()
    leases = [pool.try_acquire() for _ in range(slots)]
    try:
        assert all(lease is not None for lease in leases), "the slot stayed pinned after the view was deleted"
        assert pool.stats().pinned == 0
    finally:
        for lease in leases:
            if lease is not None:
                lease.release()
    assert_all_free(client, "affine")


def test_infer_without_copy_returns_pinned_views_and_copies_split_batches(client: TritonShmClient) -> None:
    pool = client.pool("affine")
    x = np.random.default_rng(13).standard_normal((2, 1000), dtype=np.float32)
    result = client.infer("affine", {"INPUT0": x}, copy=False)
    out = result["OUTPUT0"]
    assert result.path == "shm"
    np.testing.assert_array_equal(out, affine(x))
    assert not out.flags.writeable and not out.flags.owndata
    stats = pool.stats()
    assert (stats.pinned, stats.busy) == (1, 0), stats  # the lease ended; the view pins the slot
    # Overwrite what the view shows through another lease? It cannot get that slot.
    others = [pool.try_acquire() for _ in range(stats.slots)]
    assert sum(lease is not None for lease in others) == stats.slots - 1
    for lease in others:
        if lease is not None:
            lease.release()
    np.testing.assert_array_equal(out, affine(x))
    del result, out
    gc.collect()
    assert pool.stats().pinned == 0
    # A batch larger than a slot is split, so its outputs are assembled copies.
    big = np.random.default_rng(14).standard_normal((3, 100), dtype=np.float32)
    joined = client.infer("affine", {"INPUT0": big}, copy=False)["OUTPUT0"]
    np.testing.assert_array_equal(joined, affine(big))
    assert joined.flags.writeable  # views of a slot are read-only
    assert pool.stats().pinned == 0
    assert_all_free(client, "affine")


def test_infer_views_refuses_a_batch_larger_than_a_slot(client: TritonShmClient) -> None:
    x = np.ones((3, 10), np.float32)  # identity slots hold a batch of 2
    with pytest.raises(InputError, match="exceeds a slot's capacity"):
        with client.infer_views("identity", {"INPUT0": x}):
            pass
    assert_outputs(client.infer("identity", {"INPUT0": x}), {"OUTPUT0": x})  # infer() splits it


def test_lease_filled_in_place_then_run(client: TritonShmClient) -> None:
    inputs = multi_io_inputs(13, 2)
    want = multi_io_expected(inputs)
    with client.lease("multi_io") as lease:
        with pytest.raises(InputError, match="too big"):
            lease.input("INPUT0", (9, 3, 224, 224))
        image = lease.input("INPUT0", (2, 3, 224, 224))
        image[:] = inputs["INPUT0"]
        with pytest.raises(InputError, match="INPUT1"):
            client.run(lease)  # INPUT1 not placed yet
        ints = lease.input("INPUT1", (2, 10))
        ints[:] = inputs["INPUT1"]
        views = client.run(lease)
        assert_outputs(views, want)
        assert not any(v.flags.writeable for v in views.values())
        only = client.run(lease, outputs=["OUTPUT1"])
        assert_outputs(only, {"OUTPUT1": want["OUTPUT1"]})
        del image, ints, views, only
    assert_all_free(client, "multi_io")


def test_ainfer_runs_concurrently_under_asyncio(client: TritonShmClient) -> None:
    batches = [add_sub_inputs(20 + i, 1 + i) for i in range(6)]

    async def main() -> list[Any]:
        return await asyncio.gather(*(client.ainfer("add_sub", inputs) for inputs in batches))

    results = asyncio.run(main())
    for inputs, result in zip(batches, results, strict=True):
        assert result.path == "shm"
        assert_outputs(result, add_sub_expected(inputs))
    assert len(client.pool_stats()) == 1
    assert_all_free(client, "add_sub")


def test_ainfer_waiting_for_a_slot_leaves_the_loops_threads_free(make_client: Any) -> None:
    """Callers waiting for a slot must not hold the event loop's default threads.

    One slot; the caller holding it keeps views of its outputs until it has
    run something on the loop's default executor (as the Serve ingress does
    before encoding its answer). With the waiters in that executor, all of its
    threads waited for the slot the holder could not let go: every request
    waited out its lease timeout.
    """
    from concurrent.futures import ThreadPoolExecutor

    client = make_client(pools={"add_sub": PoolConfig(slots=1, lease_timeout_s=20.0)})
    inputs = add_sub_inputs(3, 4)
    expected = add_sub_expected(inputs)

    async def holder() -> None:
        outputs = await client.ainfer("add_sub", inputs, copy=False)  # views: the slot stays pinned
        await asyncio.sleep(0.2)  # the waiters queue up meanwhile
        await asyncio.to_thread(time.sleep, 0.01)  # needs one of the loop's default threads
        assert_outputs(outputs, expected)
        del outputs

    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(2))
        started = time.monotonic()
        results = await asyncio.gather(holder(), *(client.ainfer("add_sub", inputs) for _ in range(4)))
        for result in results[1:]:
            assert_outputs(result, expected)
        return time.monotonic() - started

    took = asyncio.run(main())
    assert took < 15, f"the waiters waited out their lease timeout: {took:.1f} s"
    assert_all_free(client, "add_sub")


def test_a_released_lease_cannot_be_used(client: TritonShmClient) -> None:
    with client.lease("add_sub") as lease:
        lease.input("INPUT0", (1, 16))[:] = 1
        lease.input("INPUT1", (1, 16))[:] = 2
    assert lease.released
    with pytest.raises(LeaseReleasedError):
        lease.input("INPUT0", (1, 16))
    with pytest.raises(LeaseReleasedError):
        lease.output("OUTPUT0", (1, 16))
    with pytest.raises(LeaseReleasedError):
        client.run(lease)
    lease.release()  # idempotent
    assert_all_free(client, "add_sub")


# -- timeouts and closing ----------------------------------------------------
def test_client_timeout_raises_deadline_exceeded_and_quarantines_the_slot(
    make_client, triton_server: TritonServer
) -> None:
    client = make_client(request_timeout_s=0.3, pools={"sleep": PoolConfig(slots=1)})
    pool = client.pool("sleep")
    done_before = _sleep_successes(triton_server)
    started = time.monotonic()
    with pytest.raises(TritonCallError) as info:
        client.infer("sleep", {"INPUT0": np.full((1, 1), 4.0, np.float32)})
    # Ended by the 0.3 s deadline, not by the 4 s answer (slack for a loaded machine).
    assert time.monotonic() - started < 3.5
    assert info.value.status == "DEADLINE_EXCEEDED"
    assert not isinstance(info.value, UnavailableError)
    stats = pool.stats()
    assert (stats.quarantined, stats.free, stats.busy) == (1, 0, 0), stats
    # The server may still write into that slot: it is not handed out again.
    assert pool.try_acquire() is None
    with pytest.raises(PoolTimeoutError):
        client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)}, timeout=0.2)
    assert pool.stats().quarantined == 1
    # Let the server finish the abandoned request (its count goes up) before unregistering.
    assert wait_for(lambda: _sleep_successes(triton_server) > done_before, 60), "the request never ended"
    close_and_check(client, allow_quarantined=True)


def _sleep_successes(server: TritonServer) -> int:
    """Requests of ``sleep`` that Triton has completed (its own statistics)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        stats = raw.get_inference_statistics("sleep", as_json=True)["model_stats"]
    return sum(int(m.get("inference_stats", {}).get("success", {}).get("count", 0)) for m in stats)


def test_close_unregisters_and_unlinks_every_segment(make_client, triton_server: TritonServer) -> None:
    client = make_client()
    client.infer("add_sub", _good())
    client.infer("scale_nobatch", {"INPUT0": np.eye(4)})
    regions = {client.pool("add_sub").region_name, client.pool("scale_nobatch").region_name}
    assert len(regions) == 2
    assert regions <= shm_names()
    assert regions <= server_regions(triton_server.grpc_url)
    client.close()
    assert not regions & shm_names()
    assert not regions & server_regions(triton_server.grpc_url)
    client.close()  # idempotent
    with pytest.raises(PoolClosedError):
        client.infer("add_sub", _good())
