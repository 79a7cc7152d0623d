"""Every model works: BYTES tensors through shared memory, reshape, variable dims without maxima.

Against the real embedded Triton serving ``deployments/models`` (``strings``: BYTES in and out;
``reshape``: dims differ from what the model sees).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
import tritonclient.http as httpclient

from ray_triton_shm import InputError, OutputTooLargeError, PoolConfig, TritonServer, TritonShmClient
from ray_triton_shm._private.serve.protocol import kserve

from .conftest import STRINGS_BOUND, default_pools


def _texts() -> np.ndarray:
    return np.array([["hello", "wörld", ""], ["a", "bb", "ccc"]], dtype=object)


def _expected(texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    upper = np.array([t.encode().upper() for t in texts.flat], dtype=object).reshape(texts.shape)
    length = np.array([len(t.encode()) for t in texts.flat], dtype=np.int32).reshape(texts.shape)
    return upper, length


def _free(client: TritonShmClient, model: str) -> bool:
    stats = next(s for s in client.pool_stats() if s.model == model)
    return stats.busy == stats.pinned == stats.quarantined == 0 and stats.free == stats.slots


def _check(result: dict, texts: np.ndarray) -> None:
    upper, length = _expected(texts)
    assert result["UPPER"].dtype == object and result["UPPER"].shape == texts.shape
    assert result["UPPER"].tolist() == upper.tolist()
    assert result["LENGTH"].dtype == np.int32
    np.testing.assert_array_equal(result["LENGTH"], length)


def test_bytes_round_trip_through_shm(client: TritonShmClient) -> None:
    texts = _texts()  # non-ASCII and empty strings
    for given in (texts, texts.astype(str), np.array([[t.encode() for t in row] for row in texts])):
        result = client.infer("strings", {"TEXT": given})  # object, numpy unicode (U), bytes (S)
        assert result.path == "shm"
        _check(result, texts)
    assert client.shm_unavailable_reason("strings") is None
    assert _free(client, "strings")


def test_bytes_through_ainfer_views_and_split_batches(client: TritonShmClient) -> None:
    texts = np.array([[b"x\x00y", b"z"]], dtype=object)  # arbitrary bytes, NUL included
    result = asyncio.run(client.ainfer("strings", {"TEXT": texts}))
    assert result.path == "shm"
    assert result["UPPER"].tolist() == [[b"X\x00Y", b"Z"]] and result["LENGTH"].tolist() == [[3, 1]]
    # copy=False and infer_views: BYTES outputs are parsed out (copies that pin nothing); the
    # numeric LENGTH is a view into the slot as always, which stays pinned while it lives.
    views = client.infer("strings", {"TEXT": texts}, copy=False)
    assert views.path == "shm" and views["UPPER"].tolist() == [[b"X\x00Y", b"Z"]]
    upper = views["UPPER"]
    with client.infer_views("strings", {"TEXT": texts}) as out:
        assert out["UPPER"].tolist() == [[b"X\x00Y", b"Z"]] and out["LENGTH"].tolist() == [[3, 1]]
    del views, out
    assert _free(client, "strings")
    assert client.infer("strings", {"TEXT": np.array([[b"other", b"qq"]], dtype=object)}).path == "shm"
    assert upper.tolist() == [[b"X\x00Y", b"Z"]]  # a copy: intact after its slot was reused
    # A batch of 5 rows over slots of 2: split, run in several slots, joined.
    rows = np.array([[f"r{i}", "é" * i, ""] for i in range(5)], dtype=object)
    split = client.infer("strings", {"TEXT": rows})
    assert split.path == "shm"
    _check(split, rows)
    assert _free(client, "strings")


def test_bytes_through_lease_and_run(client: TritonShmClient) -> None:
    texts = _texts()
    with client.lease("strings") as lease:
        with pytest.raises(InputError, match="BYTES"):
            lease.input("TEXT", texts.shape)  # strings cannot be filled in place
        lease.write_input("TEXT", np.array([[t.encode() for t in row] for row in texts], dtype=object))
        outputs = client.run(lease)
        _check(outputs, texts)
        del outputs
    assert _free(client, "strings")


def test_element_at_the_bound_fits_one_byte_over_falls_back(
    make_client: Callable[..., TritonShmClient], caplog: pytest.LogCaptureFixture
) -> None:
    """An element over the bound is known before anything is sent: gRPC, whatever grpc_fallback says."""
    at_bound = np.array([["é" * (STRINGS_BOUND // 2), "a"]], dtype=object)  # 16 bytes of UTF-8
    over = np.array([["b" * (STRINGS_BOUND + 1), "a"]], dtype=object)
    strict = make_client(pools=default_pools())  # grpc_fallback off (the default)
    assert not strict.config.grpc_fallback
    result = strict.infer("strings", {"TEXT": at_bound})
    assert result.path == "shm"
    _check(result, at_bound)
    with caplog.at_level(logging.WARNING, logger="ray_triton_shm.client"):
        for _ in range(2):
            result = strict.infer("strings", {"TEXT": over})
            assert result.path == "grpc"
            _check(result, over)
    reasons = [r.getMessage() for r in caplog.records if "'strings'" in r.getMessage()]
    assert len(reasons) == 1 and "17 bytes" in reasons[0]  # logged once per model
    # infer_views must hand out views of a slot: it cannot go over gRPC, so it says why.
    with pytest.raises(InputError, match="max_element_bytes"):
        with strict.infer_views("strings", {"TEXT": over}):
            pass
    assert _free(strict, "strings")
    # A request below min_shm_bytes goes over gRPC anyway: a long element is no error there.
    small = dataclasses.replace(default_pools()["strings"], min_shm_bytes=1 << 20)
    below = make_client(pools={"strings": small})
    result = below.infer("strings", {"TEXT": over})
    assert result.path == "grpc"
    _check(result, over)


def test_bytes_output_larger_than_its_region(make_client: Callable[..., TritonShmClient]) -> None:
    # UPPER's region holds one element per row, TEXT's four: four strings come back too large.
    small = {
        "strings": PoolConfig(
            slots=1,
            max_batch_size=1,
            max_shapes={"TEXT": (4,), "UPPER": (1,), "LENGTH": (4,)},
            max_element_bytes=STRINGS_BOUND,
            min_shm_bytes=0,
        )
    }
    texts = np.array([["abcdefgh"] * 4], dtype=object)
    strict = make_client(pools=small)
    with pytest.raises(OutputTooLargeError):
        strict.infer("strings", {"TEXT": texts})
    assert _free(strict, "strings")
    fits = strict.infer("strings", {"TEXT": texts[:, :1]})  # one element fits: still shm
    assert fits.path == "shm"
    _check(fits, texts[:, :1])
    fallback = make_client(pools=small, grpc_fallback=True)
    result = fallback.infer("strings", {"TEXT": texts})
    assert result.path == "grpc"
    _check(result, texts)
    assert _free(fallback, "strings")


def test_bytes_in_cuda_pools_go_over_grpc_and_say_why(
    make_client: Callable[..., TritonShmClient], caplog: pytest.LogCaptureFixture
) -> None:
    shapes = {"TEXT": (4,), "UPPER": (4,), "LENGTH": (4,)}
    cuda = make_client(pools={"strings": PoolConfig(memory="cuda", max_shapes=shapes)})
    texts = _texts()
    with caplog.at_level(logging.WARNING, logger="ray_triton_shm.client"):
        first = cuda.infer("strings", {"TEXT": texts})
        second = cuda.infer("strings", {"TEXT": texts})
    assert first.path == "grpc" and second.path == "grpc"
    _check(first, texts)
    reasons = [r.getMessage() for r in caplog.records if "'strings'" in r.getMessage()]
    assert len(reasons) == 1 and "BYTES/STRING" in reasons[0]
    assert "GPU memory" in (cuda.shm_unavailable_reason("strings") or "")
    # Without max_shapes the variable dims have no bound: plain gRPC too, with that reason.
    bare = make_client()
    assert bare.infer("strings", {"TEXT": texts}).path == "grpc"
    assert "variable dims" in (bare.shm_unavailable_reason("strings") or "")


def test_infer_grpc_works_without_a_layout(client: TritonShmClient) -> None:
    out = client.infer_grpc("strings", {"TEXT": np.array([["abc"]])}, outputs=["LENGTH"])
    assert list(out) == ["LENGTH"] and out["LENGTH"].tolist() == [[3]]
    assert not any(s.model == "strings" for s in client.pool_stats())  # no pool was made


def test_bytes_inputs_are_checked(client: TritonShmClient) -> None:
    with pytest.raises(InputError, match="bytes or str"):
        client.infer("strings", {"TEXT": np.array([[1.0]], dtype=np.float32)})
    with pytest.raises(InputError, match="rank"):
        client.infer("strings", {"TEXT": np.array(["flat"], dtype=object)})
    with pytest.raises(InputError, match="missing"):
        client.infer("strings", {})


def test_variable_dims_without_maxima_go_over_grpc(client: TritonShmClient) -> None:
    # `multi_io`-style fixed models keep slots; `identity` without max_shapes in this client has none.
    data = np.arange(10, dtype=np.float32).reshape(1, 10)
    with TritonShmClient(url=client.config.url) as bare:  # no pools given: identity's dim is unbounded
        result = bare.infer("identity", {"INPUT0": data})
        assert result.path == "grpc"
        np.testing.assert_array_equal(result["OUTPUT0"], data)
        assert "variable dims" in (bare.shm_unavailable_reason("identity") or "")


def test_reshape_model_goes_through_shm(client: TritonShmClient) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = client.infer("reshape", {"INPUT0": data})
    assert result.path == "shm"
    expected = data.reshape(3, 2, 2).swapaxes(1, 2).reshape(3, 4)
    np.testing.assert_array_equal(result["OUTPUT0"], expected)
    np.testing.assert_array_equal(client.infer_grpc("reshape", {"INPUT0": data})["OUTPUT0"], expected)


@pytest.mark.parametrize("binary", [False, True])
def test_kserve_bytes_encoding_matches_triton(triton_server: TritonServer, binary: bool) -> None:
    """Our v2 encoder and decoder agree with Triton's own HTTP endpoint on BYTES tensors."""
    texts = np.array([["héllo", "x"]], dtype=object)
    tensor = httpclient.InferInput("TEXT", [1, 2], "BYTES")
    tensor.set_data_from_numpy(texts, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("UPPER", "LENGTH")]
    body, header_length = httpclient.InferenceServerClient.generate_request_body([tensor], outputs)
    request = kserve.decode_request(body, header_length)
    assert request.inputs["TEXT"].tolist() == [[b"h\xc3\xa9llo", b"x"]]
    url = f"http://{triton_server.http_url}/v2/models/strings/infer"
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    with urllib.request.urlopen(urllib.request.Request(url, body, headers)) as reply:
        triton_body = reply.read()
        triton_length = reply.headers.get("Inference-Header-Content-Length")
    triton_head = json.loads(triton_body[: int(triton_length) if triton_length else None])
    ours_body, ours_headers = kserve.encode_response(
        "strings",
        request,
        {"UPPER": np.array([[b"H\xc3\xa9LLO", b"X"]], dtype=object), "LENGTH": np.array([[6, 1]], np.int32)},
    )
    ours_length = ours_headers.get(kserve.HEADER_LENGTH)
    ours_head = json.loads(ours_body[: int(ours_length) if ours_length else None])
    assert [o for o in ours_head["outputs"]] == triton_head["outputs"]
    ours_blobs = ours_body[int(ours_length or len(ours_body)) :]
    assert ours_blobs == triton_body[int(triton_length or len(triton_body)) :]
