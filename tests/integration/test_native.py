"""The client against a server that reads and writes our slots in place: the native C backend.

``deployments/native_models`` run on ``rts_native`` (native/rts_native.c, built by
``make native``): its identity memcpys the input buffer Triton hands it into the
output buffer Triton gives back, and through shared memory both are the server's
mappings of our own segment. Every client path runs here against it, and
:func:`test_server_reads_and_writes_our_slots_in_place` proves the in-place part
from the server's own memory maps.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm import (
    InputError,
    PoolConfig,
    ServerConfig,
    ServerStartError,
    TritonServer,
    TritonShmClient,
)
from ray_triton_shm._private.triton.native import require_native_models

from .conftest import NATIVE_MODEL_REPOSITORY, close_and_check, transport_overrides
from .test_client import (
    assert_all_free,
    assert_outputs,
    multi_io_expected,
    multi_io_inputs,
    server_regions,
    shm_names,
)

IDENTITY_MAX = 1 << 18  # float32 elements a slot of the identity pool holds (1 MB)
PROBE_MAX = 1 << 16


def native_pools() -> dict[str, PoolConfig]:
    return {
        "identity": PoolConfig(
            slots=2, max_batch_size=2, max_shapes={"INPUT0": (IDENTITY_MAX,), "OUTPUT0": (IDENTITY_MAX,)}
        ),
        "multi_io": PoolConfig(slots=2, max_batch_size=4),
        "probe": PoolConfig(slots=3, max_shapes={"INPUT0": (PROBE_MAX,), "OUTPUT0": (PROBE_MAX,)}),
    }


@pytest.fixture(scope="module")
def native_server() -> Iterator[TritonServer]:
    """Triton on ``deployments/native_models`` (fails, saying ``make native``, when unbuilt)."""
    server = TritonServer(ServerConfig(model_repository=require_native_models(str(NATIVE_MODEL_REPOSITORY))))
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_alive()


@pytest.fixture
def native(native_server: TritonServer, shm_transport: str) -> Iterator[TritonShmClient]:
    """A client of the native server over each shm transport, closed and checked after the test."""
    client = TritonShmClient(**transport_overrides(native_server, shm_transport), pools=native_pools())
    yield client
    close_and_check(client)


# -- the server's memory maps ----------------------------------------------------
def server_mapping(pid: int, address: int) -> tuple[str, int, int]:
    """``(path, file offset, inode)`` of the mapping holding ``address`` in process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                path = fields[5].strip() if len(fields) > 5 else ""
                return path, int(fields[2], 16) + (address - start), int(fields[4])
    raise AssertionError(f"{address:#x} is in no mapping of process {pid}")


def spec_offset(client: TritonShmClient, model: str, name: str) -> int:
    layout = client.layout(model)
    return next(s.offset for s in (*layout.inputs, *layout.outputs) if s.name == name)


def test_server_reads_and_writes_our_slots_in_place(
    native: TritonShmClient, native_server: TritonServer
) -> None:
    """Each slot's input and output are where the backend read and wrote, in the server's own mapping."""
    pid = native_server.pid
    assert pid is not None
    pool = native.pool("probe")
    region_path = f"/dev/shm/{pool.region_name}"
    region_inode = os.stat(region_path).st_ino
    in_at = spec_offset(native, "probe", "INPUT0")
    out_at = spec_offset(native, "probe", "OUTPUT0")
    rng = np.random.default_rng(1)
    leases = [native.lease("probe") for _ in range(pool.stats().slots)]
    seen = set()
    try:
        for n, lease in enumerate(leases):
            x = rng.standard_normal(1000 + n, dtype=np.float32)
            lease.input("INPUT0", x.shape)[:] = x  # filled in place: no copy on our side either
            outputs = native.run(lease)
            np.testing.assert_array_equal(outputs["OUTPUT0"], x)
            in_addr, in_bytes, out_addr, out_bytes = (int(v) for v in outputs["ADDRESSES"])
            assert (in_bytes, out_bytes) == (x.nbytes, x.nbytes)
            for address, offset in ((in_addr, lease.offset + in_at), (out_addr, lease.offset + out_at)):
                path, file_offset, inode = server_mapping(pid, address)
                assert path.split(" (deleted)")[0] == region_path, (path, region_path)
                assert inode == region_inode, "the server mapped another file of that name"
                assert file_offset == offset, f"server used offset {file_offset}, the slot is at {offset}"
            seen.add((in_addr, out_addr))
            del outputs  # views of the slot: they would pin it past its lease
    finally:
        for lease in leases:
            lease.release()
    assert len(seen) == len(leases), "different slots must be different places in the server's mapping"
    assert_all_free(native, "probe")


def test_probe_through_views_reports_the_view_slot(
    native: TritonShmClient, native_server: TritonServer
) -> None:
    """``infer_views``: the output views are the very bytes the backend wrote."""
    x = np.arange(777, dtype=np.float32)
    pid = native_server.pid
    assert pid is not None
    with native.infer_views("probe", {"INPUT0": x}) as views:
        out_addr = int(views["ADDRESSES"][2])
        np.testing.assert_array_equal(views["OUTPUT0"], x)
        _, file_offset, _ = server_mapping(pid, out_addr)
        ours = server_mapping(os.getpid(), views["OUTPUT0"].__array_interface__["data"][0])
        assert ours[0].split(" (deleted)")[0] == f"/dev/shm/{native.pool('probe').region_name}"
        assert ours[1] == file_offset, "our view and the server's write are different bytes of the segment"
    del views
    assert_all_free(native, "probe")


# -- the client's paths -----------------------------------------------------------
def test_multi_io_matches_numpy_and_the_python_model(native: TritonShmClient) -> None:
    for batch in (1, 3):
        inputs = multi_io_inputs(20 + batch, batch)
        result = native.infer("multi_io", inputs)
        assert result.path == "shm"
        assert_outputs(result, multi_io_expected(inputs))


def test_identity_variable_sizes_in_one_slot(native: TritonShmClient) -> None:
    rng = np.random.default_rng(2)
    for n in (1, 17, 4096, IDENTITY_MAX, 3):
        x = rng.standard_normal((2, n), dtype=np.float32)
        result = native.infer("identity", {"INPUT0": x})
        assert result.path == "shm"
        assert_outputs(result, {"OUTPUT0": x})
    assert_all_free(native, "identity")


def test_batches_above_max_batch_size_are_chunked(native: TritonShmClient) -> None:
    inputs = multi_io_inputs(3, 19)  # model max_batch_size 8, slots of 4: five chunks over two slots
    assert_outputs(native.infer("multi_io", inputs), multi_io_expected(inputs))
    x = np.random.default_rng(4).standard_normal((11, 300), dtype=np.float32)
    assert_outputs(native.infer("identity", {"INPUT0": x}, copy=False), {"OUTPUT0": x})
    assert_all_free(native, "multi_io")
    assert_all_free(native, "identity")


def test_views_pin_the_slot_until_the_last_view_dies(native: TritonShmClient) -> None:
    pool = native.pool("identity")
    x = np.random.default_rng(5).standard_normal((2, 5000), dtype=np.float32)
    result = native.infer("identity", {"INPUT0": x}, copy=False)
    out = result["OUTPUT0"]
    np.testing.assert_array_equal(out, x)
    assert not out.flags.writeable
    assert (pool.stats().pinned, pool.stats().busy) == (1, 0)
    # The other slot keeps serving; the pinned one is not handed out, so its bytes stay.
    for seed in range(3):
        y = np.random.default_rng(seed).standard_normal((1, 5000), dtype=np.float32)
        assert_outputs(native.infer("identity", {"INPUT0": y}), {"OUTPUT0": y})
    np.testing.assert_array_equal(out, x)
    del result, out
    gc.collect()
    assert pool.stats().pinned == 0
    leases = [pool.try_acquire() for _ in range(pool.stats().slots)]
    try:
        assert all(lease is not None for lease in leases), "the slot was not reused after its last view died"
    finally:
        for lease in leases:
            if lease is not None:
                lease.release()
    assert_all_free(native, "identity")


def test_lease_filled_in_place_then_run(native: TritonShmClient) -> None:
    inputs = multi_io_inputs(6, 2)
    with native.lease("multi_io") as lease:
        for name, value in inputs.items():
            lease.input(name, value.shape)[:] = value
        views = native.run(lease)
        assert_outputs(views, multi_io_expected(inputs))
        assert not any(v.flags.writeable for v in views.values())
        del views  # the lease ends with the block; a view kept past it would pin the slot
    assert_all_free(native, "multi_io")


def test_concurrent_threads_each_get_their_own_answer(native: TritonShmClient) -> None:
    failures: list[str] = []

    def caller(thread: int) -> None:
        try:
            rng = np.random.default_rng(thread)
            for i in range(15):
                x = rng.standard_normal((1 + i % 2, 100 + thread * 31 + i), dtype=np.float32)
                assert_outputs(native.infer("identity", {"INPUT0": x}), {"OUTPUT0": x})
                if i % 5 == 0:
                    inputs = multi_io_inputs(thread * 100 + i, 1 + i % 4)
                    assert_outputs(native.infer("multi_io", inputs), multi_io_expected(inputs))
        except BaseException as e:
            failures.append(f"thread {thread}: {e!r}")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    assert_all_free(native, "identity")
    assert_all_free(native, "multi_io")


def _process_worker(url: str, seed: int, results: Any) -> None:
    """Runs in a spawned process: its own client and pool, identity calls it checks itself."""
    try:
        with TritonShmClient(url=url, pools=native_pools()) as client:
            rng = np.random.default_rng(seed)
            for i in range(10):
                x = rng.standard_normal((1, 1000 + seed * 10 + i), dtype=np.float32)
                result = client.infer("identity", {"INPUT0": x})
                if result.path != "shm" or not np.array_equal(result["OUTPUT0"], x):
                    raise AssertionError(f"call {i}: wrong answer over {result.path}")
            region = client.pool("identity").region_name
        results.put((seed, region, None))
    except BaseException as e:
        results.put((seed, None, repr(e)))


@pytest.mark.slow
def test_several_processes_share_the_native_server(native_server: TritonServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(native_server.grpc_url, s, results)) for s in range(3)]
    for p in procs:
        p.start()
    try:
        answers = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert all(error is None for *_, error in answers), answers
    regions = {region for _, region, _ in answers}
    assert len(regions) == 3
    assert not regions & shm_names(), "a process left its segment behind"
    assert not regions & server_regions(native_server.grpc_url), "a region stayed registered"


# -- bad inputs -------------------------------------------------------------------
@pytest.mark.parametrize(
    "inputs",
    [
        {"INPUT0": np.ones((1, 10), np.int32)},  # wrong dtype
        {"INPUT0": np.ones((1, 10), np.float32), "EXTRA": np.ones((1, 10), np.float32)},
        {},  # missing input
        {"INPUT0": np.ones((1, IDENTITY_MAX + 1), np.float32)},  # larger than a slot's shape
    ],
    ids=["dtype", "unknown", "missing", "too-long"],
)
def test_bad_inputs_raise_input_error_and_free_every_slot(native: TritonShmClient, inputs: dict) -> None:
    with pytest.raises(InputError):
        native.infer("identity", inputs)
    assert_all_free(native, "identity")


def _grpc_infer(url: str, model: str, arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> Any:
    with grpcclient.InferenceServerClient(url) as triton:
        tensors = []
        for name, value in arrays.items():
            tensor = grpcclient.InferInput(name, list(value.shape), dtypes[name])
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return triton.infer(model, tensors)


def test_the_backend_answers_bad_requests_with_errors_and_keeps_serving(native_server: TritonServer) -> None:
    """Requests our client would refuse, sent by hand: Triton errors, never a crashed server."""
    url = native_server.grpc_url
    image = np.ones((1, 3, 224, 224), np.float32)
    with pytest.raises(InferenceServerException, match="INPUT1"):
        _grpc_infer(url, "multi_io", {"INPUT0": image}, {"INPUT0": "FP32"})
    with pytest.raises(InferenceServerException):
        _grpc_infer(url, "identity", {"INPUT0": np.ones((1, 4), np.int32)}, {"INPUT0": "INT32"})
    with pytest.raises(InferenceServerException):  # batches that disagree between inputs
        _grpc_infer(
            url,
            "multi_io",
            {"INPUT0": image, "INPUT1": np.ones((2, 10), np.int32)},
            {"INPUT0": "FP32", "INPUT1": "INT32"},
        )
    empty = _grpc_infer(url, "identity", {"INPUT0": np.ones((1, 0), np.float32)}, {"INPUT0": "FP32"})
    assert empty.as_numpy("OUTPUT0").shape == (1, 0)
    assert native_server.is_alive()
    x = np.arange(12, dtype=np.float32).reshape(1, 12)
    np.testing.assert_array_equal(
        _grpc_infer(url, "identity", {"INPUT0": x}, {"INPUT0": "FP32"}).as_numpy("OUTPUT0"), x
    )


def test_a_model_with_an_unknown_op_fails_to_load_with_the_backends_message(tmp_path) -> None:
    """The backend refuses a config it cannot serve as a Triton error at load: the server says why."""
    repository = tmp_path / "models"
    shutil.copytree(NATIVE_MODEL_REPOSITORY / "identity", repository / "identity")
    config = repository / "identity" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "identity"', 'string_value: "nope"'))
    server = TritonServer(ServerConfig(model_repository=str(repository), startup_timeout_s=120))
    with pytest.raises(ServerStartError) as failed:
        server.start()
    assert not server.is_alive()
    assert "rts_native knows identity, multi_io, probe" in failed.value.log_tail + str(failed.value)
