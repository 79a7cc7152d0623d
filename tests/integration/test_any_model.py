"""Models without a fixed slot layout still work: BYTES tensors, reshape, variable dims without maxima.

Against the real embedded Triton serving ``deployments/models`` (``strings``: BYTES in and out;
``reshape``: dims differ from what the model sees).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

from ray_triton_shm import InputError, TritonServer, TritonShmClient
from ray_triton_shm._private import kserve


def _texts() -> np.ndarray:
    return np.array([["hello", "wörld", ""], ["a", "bb", "ccc"]], dtype=object)


def _expected(texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    upper = np.array([t.encode().upper() for t in texts.flat], dtype=object).reshape(texts.shape)
    length = np.array([len(t.encode()) for t in texts.flat], dtype=np.int32).reshape(texts.shape)
    return upper, length


def test_bytes_model_through_infer_goes_over_grpc_and_says_why(
    client: TritonShmClient, caplog: pytest.LogCaptureFixture
) -> None:
    texts = _texts()
    upper, length = _expected(texts)
    with caplog.at_level(logging.WARNING, logger="ray_triton_shm.client"):
        first = client.infer("strings", {"TEXT": texts})
        second = client.infer("strings", {"TEXT": texts.astype(str)})  # numpy unicode works too
    assert first.path == "grpc" and second.path == "grpc"
    for result in (first, second):
        assert result["UPPER"].dtype == object
        assert result["UPPER"].tolist() == upper.tolist()
        np.testing.assert_array_equal(result["LENGTH"], length)
    reasons = [r.getMessage() for r in caplog.records if "'strings'" in r.getMessage()]
    assert len(reasons) == 1 and "BYTES/STRING" in reasons[0]  # logged once per model
    assert "BYTES/STRING" in (client.shm_unavailable_reason("strings") or "")
    assert client.shm_unavailable_reason("add_sub") is None


def test_bytes_model_through_ainfer(client: TritonShmClient) -> None:
    texts = np.array([[b"x\x00y", b"z"]], dtype=object)  # arbitrary bytes, NUL included
    result = asyncio.run(client.ainfer("strings", {"TEXT": texts}))
    assert result.path == "grpc"
    assert result["UPPER"].tolist() == [[b"X\x00Y", b"Z"]]
    assert result["LENGTH"].tolist() == [[3, 1]]


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
