"""Single node: Serve from the config file, HTTP with tritonclient.http, the handle, Ray Data."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def test_http_protocol_round_trip_with_tritonclient(serve_app):
    _, address = serve_app
    with httpclient.InferenceServerClient(address) as client:
        _round_trips(client)


def _round_trips(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_model_metadata("multi_io")
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
    rng = np.random.default_rng(1)
    a = rng.integers(-50, 50, (3, 16), dtype=np.int32)
    b = rng.integers(-50, 50, (3, 16), dtype=np.int32)
    for binary in (True, False):
        inputs = [
            httpclient.InferInput("INPUT0", [3, 16], "INT32"),
            httpclient.InferInput("INPUT1", [3, 16], "INT32"),
        ]
        inputs[0].set_data_from_numpy(a, binary_data=binary)
        inputs[1].set_data_from_numpy(b, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
        result = client.infer("add_sub", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    image = rng.random((2, 3, 224, 224), dtype=np.float32)
    ints = rng.integers(0, 9, (2, 10), dtype=np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", list(image.shape), "FP32"),
        httpclient.InferInput("INPUT1", [2, 10], "INT32"),
    ]
    inputs[0].set_data_from_numpy(image)
    inputs[1].set_data_from_numpy(ints)
    result = client.infer("multi_io", inputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), image.reshape(2, 512, 294).sum(-1), rtol=1e-4)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), ints.reshape(2, 5, 2).sum(-1))


def test_http_bad_input_is_a_clear_client_error(serve_app):
    _, address = serve_app
    wrong = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 16), np.float32))
    other = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    other.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with httpclient.InferenceServerClient(address) as client:
        with pytest.raises(InferenceServerException, match="dtype"):
            client.infer("add_sub", [wrong, other])


def test_handle_round_trip_uses_shm(serve_app):
    handle, _ = serve_app
    x = np.arange(12 * 1000, dtype=np.float32).reshape(12, 1000)
    outputs, origin = handle.infer_with_origin.remote("whoami", {"INPUT0": x}).result()
    np.testing.assert_array_equal(outputs["OUTPUT0"], x)
    assert origin["path"] == "shm"
    assert set(outputs["SERVER_PID"].ravel()) == {origin["triton_pid"]}
    a = np.ones((4, 16), np.int32)
    outputs = handle.infer.remote("add_sub", {"INPUT0": a, "INPUT1": a}).result()
    np.testing.assert_array_equal(outputs["OUTPUT0"], 2 * a)


def _add_sub_bytes_reported() -> int:
    from ray_triton_shm._private.cli import status

    return sum(
        entry["bytes"]
        for node in status.collect()
        for entry in node.get("traffic", [])
        if entry["model"] == "add_sub"
    )


def _settled_add_sub_bytes() -> int:
    """The reported sum once earlier tests' last reports (sent every 0.25 s) have landed."""
    last = _add_sub_bytes_reported()
    while True:
        time.sleep(0.6)
        now = _add_sub_bytes_reported()
        if now == last:
            return now
        last = now


def test_ray_data_ten_thousand_rows_every_output_checked(serve_app):
    import ray

    from ray_triton_shm.data import TritonPredictor

    reported_before = _settled_add_sub_bytes()

    rows = 10_000
    ids = np.arange(rows, dtype=np.int32)
    ds = (
        ray.data.from_numpy(np.stack([ids] * 16, axis=1))
        .repartition(4)
        .map_batches(
            lambda b: {"INPUT0": b["data"], "INPUT1": np.full_like(b["data"], 3)}, batch_format="numpy"
        )
    )
    out = ds.map_batches(
        TritonPredictor,
        fn_constructor_kwargs={"model": "add_sub"},
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.25,  # 2 CPUs in all, Serve replicas hold some
        batch_size=500,
        batch_format="numpy",
    ).take_all()
    assert len(out) == rows
    seen = set()
    for row in out:
        np.testing.assert_array_equal(row["OUTPUT0"], row["INPUT0"] + 3)
        np.testing.assert_array_equal(row["OUTPUT1"], row["INPUT0"] - 3)
        seen.add(int(row["INPUT0"][0]))
    assert seen == set(range(rows))
    # Ray Data kills its workers without a close: every batch's traffic must still reach
    # the node actor (2 inputs + 2 outputs of 16 int32 per row), whatever the path.
    want = rows * 4 * 16 * 4
    deadline = time.monotonic() + 10
    while (moved := _add_sub_bytes_reported() - reported_before) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert moved == want


def test_ray_data_pandas_batches(serve_app):
    import ray

    from ray_triton_shm.data import TritonPredictor

    items = [
        {"INPUT0": np.full(16, i, np.int32), "INPUT1": np.arange(16, dtype=np.int32)} for i in range(300)
    ]
    out = (
        ray.data.from_items(items)
        .map_batches(
            TritonPredictor,
            fn_constructor_kwargs={"model": "add_sub"},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=0.25,
            batch_size=64,
            batch_format="pandas",
        )
        .take_all()
    )
    assert len(out) == 300
    for row in out:
        np.testing.assert_array_equal(row["OUTPUT0"], row["INPUT0"] + np.arange(16))


def _strings_traffic() -> dict[str, int]:
    """Requests of the ``strings`` model by path, as the node actor counts them (clients' reports)."""
    import ray

    from ray_triton_shm.node import get_node_actor

    rows = ray.get(get_node_actor().status.remote())["traffic"]
    return {row["path"]: row["requests"] for row in rows if row["model"] == "strings"}


def _wait_for_traffic(start: dict[str, int], shm_at_least: int, timeout: float = 60.0) -> dict[str, int]:
    """Wait until the node counted ``shm_at_least`` more shm requests of ``strings`` than ``start``."""
    deadline = time.monotonic() + timeout
    while True:
        now = _strings_traffic()
        if now.get("shm", 0) - start.get("shm", 0) >= shm_at_least:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the node counted {now} after {start}; wanted {shm_at_least} more shm")
        time.sleep(0.5)


def test_bytes_model_through_handle_http_and_ray_data(serve_app):
    """A BYTES (text) model through every entry point, all through the node's shared-memory slots.

    The app's pools give ``strings`` a slot layout (``max_shapes``, ``max_element_bytes``):
    the handle reports path ``shm``; the HTTP ingress and Ray Data are seen in the node's
    traffic counts by path, where no ``strings`` request goes over gRPC.
    """
    import ray

    from ray_triton_shm.data import TritonPredictor

    handle, address = serve_app
    start = _strings_traffic()
    texts = np.array([["hello", "wörld"]], dtype=object)
    outputs, origin = handle.infer_with_origin.remote("strings", {"TEXT": texts}).result()
    assert origin["path"] == "shm"
    assert outputs["UPPER"].tolist() == [[b"HELLO", "wörld".encode().upper()]]
    assert outputs["LENGTH"].tolist() == [[5, 6]]
    # infer (copy=False in the replica): BYTES outputs are copies, numeric ones views, both arrive.
    result = handle.infer.remote("strings", {"TEXT": texts}).result()
    assert result["LENGTH"].tolist() == [[5, 6]] and result["UPPER"].tolist()[0][0] == b"HELLO"
    after_handle = _wait_for_traffic(start, 2)

    with httpclient.InferenceServerClient(address) as client:
        for binary in (False, True):
            tensor = httpclient.InferInput("TEXT", [1, 2], "BYTES")
            tensor.set_data_from_numpy(texts, binary_data=binary)
            wanted = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("UPPER", "LENGTH")]
            result = client.infer("strings", [tensor], outputs=wanted)
            # tritonclient gives JSON BYTES back as str, binary ones as bytes (as against Triton itself)
            upper = [u if isinstance(u, bytes) else u.encode() for u in result.as_numpy("UPPER").ravel()]
            assert upper == [b"HELLO", "wörld".encode().upper()]
            assert result.as_numpy("LENGTH").tolist() == [[5, 6]]
    after_http = _wait_for_traffic(after_handle, 2)

    items = [{"TEXT": np.array([f"row{i}", "x" * (i % 5)], dtype=object)} for i in range(50)]
    rows = (
        ray.data.from_items(items)
        .map_batches(
            TritonPredictor,
            fn_constructor_kwargs={"model": "strings"},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=0.25,
            batch_size=8,
        )
        .take_all()
    )
    assert len(rows) == 50
    for row in rows:
        assert [t.upper() for t in row["TEXT"]] == [u.decode() for u in row["UPPER"]]
        assert row["LENGTH"].tolist() == [len(t) for t in row["TEXT"]]
    # 50 rows in batches of 8 (Ray Data may cut them differently, but into 7 at least).
    final = _wait_for_traffic(after_http, 7)
    assert final.get("grpc", 0) == start.get("grpc", 0)  # no strings request went over gRPC

    # An element longer than the app's bound (256 bytes) still gets Triton's answer: over gRPC.
    long_text = np.array([["z" * 300]], dtype=object)
    outputs, origin = handle.infer_with_origin.remote("strings", {"TEXT": long_text}).result()
    assert origin["path"] == "grpc"
    assert outputs["UPPER"].tolist() == [[b"Z" * 300]] and outputs["LENGTH"].tolist() == [[300]]
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(long_text, binary_data=True)
    wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("UPPER", "LENGTH")]
    with httpclient.InferenceServerClient(address) as client:
        result = client.infer("strings", [tensor], outputs=wanted)
    assert result.as_numpy("UPPER").tolist() == [[b"Z" * 300]]
    assert result.as_numpy("LENGTH").tolist() == [[300]]


def test_bytes_through_node_client(serve_app):
    """NodeClient (the driver, on the app's node Triton): BYTES through the node's slots."""
    import asyncio

    from ray_triton_shm import InputError
    from ray_triton_shm.node import NodeClient

    texts = np.array([["héllo", "", "x\x00y"]], dtype=object)
    with NodeClient() as client:
        result = client.infer("strings", {"TEXT": texts})
        assert result.path == "shm"
        assert result["UPPER"].tolist() == [["HéLLO".encode(), b"", b"X\x00Y"]]
        assert result["LENGTH"].tolist() == [[6, 0, 3]]
        result = asyncio.run(client.ainfer("strings", {"TEXT": texts.astype(str)}))
        assert result.path == "shm" and result["LENGTH"].tolist() == [[6, 0, 3]]
        # The app's bound is 256 bytes: a longer element goes over gRPC, and says so.
        result = client.infer("strings", {"TEXT": np.array([["y" * 257]], dtype=object)})
        assert result.path == "grpc" and result["UPPER"].tolist() == [[b"Y" * 257]]
        with pytest.raises(InputError, match="max_element_bytes"):  # views must live in a slot
            with client.infer_views("strings", {"TEXT": np.array([["y" * 257]], dtype=object)}):
                pass
        stats = next(s for s in client.client.pool_stats() if s.model == "strings")
        assert stats.busy == stats.pinned == stats.quarantined == 0
