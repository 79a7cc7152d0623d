"""Slot references through Serve handles: real Ray, real Triton, the package's Serve app.

The caller (this driver, on the replica's node) leases slots through its own
NodeClient, fills them in place, sends a SlotRef through the handle, and reads
the outputs in the slot. Expected outputs are computed here with numpy
(``affine``: 1 - 2x, ``multi_io``: row sums), never by the code under test;
"nothing ran" is read from Triton's own inference statistics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import numpy as np
import pytest

from tests.helpers import free_port

from .conftest import local_ray

ARGS = {
    "model_repository": "examples",
    "quarantine_s": 1.0,
    "pools": {
        "affine": {"slots": 4, "max_batch_size": 1, "max_shapes": {"INPUT0": [4096], "OUTPUT0": [4096]}},
        "multi_io": {"slots": 2, "max_batch_size": 2},
    },
}
OTHER_ARGS = {**ARGS, "quarantine_s": 2.0}  # another node config: no node actor for it runs here


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{pid}_")]


@pytest.fixture(scope="module")
def app():
    """(handle, caller, node actor pid): one replica of the Serve app, a SlotRefCaller on this node."""
    from ray import serve

    from ray_triton_shm.serve import SlotRefCaller
    from ray_triton_shm.serve import app as build

    actor_pid = None
    caller = None
    with local_ray():
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
            handle = serve.run(build(ARGS), name="refs", route_prefix=None)
            actor_pid = handle.whereami.remote().result()["actor_pid"]
            caller = SlotRefCaller(handle, args=ARGS)
            yield handle, caller, actor_pid
        finally:
            if caller is not None:
                caller.close()
    deadline = time.monotonic() + 60
    while actor_pid is not None and _segments(actor_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert actor_pid is None or _segments(actor_pid) == [], "segments left in /dev/shm"


def _successes(caller, model: str) -> int:
    stats = caller.node_client().client._grpc.get_inference_statistics(model, as_json=True)
    return sum(int(s["inference_stats"]["success"].get("count", 0)) for s in stats["model_stats"])


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_ref_round_trip_reads_outputs_in_the_slot(app) -> None:
    import ray

    handle, caller, _ = app
    x = np.linspace(-3, 3, 1000, dtype=np.float32)[None]
    with caller.lease("affine") as lease:
        assert lease.in_slot
        lease.input("INPUT0", x.shape)[...] = x
        out = caller.run(lease)
        assert out.path == "slot_ref"
        np.testing.assert_allclose(out["OUTPUT0"], 1 - 2 * x, rtol=1e-6)
        # Read in place: the output is the slot's own OUTPUT0 region.
        assert _address(out["OUTPUT0"]) == _address(lease.lease.slot.arrays["OUTPUT0"])
        assert not out["OUTPUT0"].flags.writeable
        # The local replica served it (the replica checks the ref's node too), through a handle
        # that prefers replicas on this node (Serve's local routing, set at the handle's init).
        assert caller.handle.init_options._prefer_local_routing
        assert lease.served_by["node_id"] == ray.get_runtime_context().get_node_id()
        assert lease.served_by["pid"] == handle.whereami.remote().result()["pid"]


def test_multi_io_round_trip_with_two_inputs(app) -> None:
    _, caller, _ = app
    rng = np.random.default_rng(3)
    image = rng.random((2, 3, 224, 224), dtype=np.float32)
    ints = rng.integers(-100, 100, (2, 10), dtype=np.int32)
    with caller.lease("multi_io") as lease:
        lease.input("INPUT0", image.shape)[...] = image
        lease.input("INPUT1", ints.shape)[...] = ints
        out = caller.run(lease, outputs=["OUTPUT0", "OUTPUT1"])
        assert out.path == "slot_ref"
        np.testing.assert_allclose(out["OUTPUT0"], image.reshape(2, 512, 294).sum(-1), rtol=1e-4)
        np.testing.assert_array_equal(out["OUTPUT1"], ints.reshape(2, 5, 2).sum(-1))


def test_async_callers_share_the_pool(app) -> None:
    _, caller, _ = app

    async def one(i: int) -> None:
        x = np.full((1, 64 + i), float(i), np.float32)
        with await caller.alease("affine") as lease:
            lease.input("INPUT0", x.shape)[...] = x
            out = await caller.arun(lease)
            assert out.path == "slot_ref"
            np.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(main())


def test_stale_ref_is_refused_and_nothing_runs(app) -> None:
    from ray_triton_shm._private.serve.slot_ref import make_ref
    from ray_triton_shm.errors import StaleSlotRefError

    handle, caller, _ = app
    lease = caller.lease("affine")
    lease.input("INPUT0", (1, 8))[...] = 1.0
    ref = make_ref(lease.lease, caller.node_id)
    lease.release()
    before = _successes(caller, "affine")
    for through in (caller.ref_handle, handle):  # Serve's gRPC transport, and the object store
        with pytest.raises(StaleSlotRefError):
            through.infer_ref.remote(ref).result()
    assert _successes(caller, "affine") == before


def test_ref_of_a_process_not_holding_the_slot_is_refused(app) -> None:
    from ray_triton_shm._private.serve.slot_ref import make_ref
    from ray_triton_shm._private.shm.slot_table import lease_token
    from ray_triton_shm.errors import StaleSlotRefError

    _, caller, _ = app
    with caller.lease("affine") as lease:
        lease.input("INPUT0", (1, 8))[...] = 1.0
        ref = make_ref(lease.lease, caller.node_id)
        other = ref.pid + 1
        forged = dataclasses.replace(ref, pid=other, token=lease_token(other, 12345))
        before = _successes(caller, "affine")
        with pytest.raises(StaleSlotRefError):
            caller.ref_handle.infer_ref.remote(forged).result()
        assert _successes(caller, "affine") == before
        # The holder's own ref still runs.
        assert caller.run(lease).path == "slot_ref"


def test_a_ref_from_another_node_falls_back_to_arrays(app) -> None:
    from ray_triton_shm._private.serve.slot_ref import make_ref
    from ray_triton_shm.errors import SlotRefElsewhereError

    _, caller, _ = app
    x = np.arange(50, dtype=np.float32)[None]
    with caller.lease("affine") as lease:
        lease.input("INPUT0", x.shape)[...] = x
        ref = dataclasses.replace(make_ref(lease.lease, caller.node_id), node_id="f" * 56)
        with pytest.raises(SlotRefElsewhereError):
            caller.ref_handle.infer_ref.remote(ref).result()
        # The caller, believing itself on another node, sends its arrays instead, transparently.
        real = caller.node_id
        caller.node_id = "f" * 56
        try:
            out = caller.run(lease)
        finally:
            caller.node_id = real
        assert out.path == "handle"
        np.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)


def test_without_a_node_actor_here_the_caller_sends_arrays(app) -> None:
    from ray_triton_shm.serve import SlotRefCaller

    handle, _, _ = app
    x = np.arange(20, dtype=np.float32)[None]
    with SlotRefCaller(handle, args=OTHER_ARGS) as caller:
        assert caller.node_client() is None  # no node actor runs OTHER_ARGS: none was started
        with caller.lease("affine") as lease:
            assert not lease.in_slot
            lease.input("INPUT0", x.shape)[...] = x
            out = caller.run(lease)
        assert out.path == "handle"
        np.testing.assert_array_equal(out["OUTPUT0"], 1 - 2 * x)
        plain = caller.infer("affine", {"INPUT0": x})
        assert plain.path == "handle"
        np.testing.assert_array_equal(plain["OUTPUT0"], 1 - 2 * x)


def test_every_slot_is_back(app) -> None:
    handle, caller, _ = app
    busy = handle.whereami.remote().result()["busy"]
    assert all(count == 0 for count in busy.values()), busy
    for stats in caller.node_client().client.pool_stats():
        assert stats.busy == stats.pinned == 0, stats
        table = caller.node_client().client.pool(stats.model)._table
        assert table.state()["in_use"] == 0
