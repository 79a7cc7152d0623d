"""The lean HTTP ingress path: one copy of the payload each way, measured with tracemalloc (no timing).

A 16 MB binary KServe v2 request is planned from its header and its chunks
written into a stand-in slot buffer; the answer is encoded from views of
another. Each copy of the payload our code made would show as one payload of
Python-allocated memory (numpy's buffers are traced too: checked first).
"""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from ray_triton_shm._private import kserve, kserve_http
from ray_triton_shm.errors import InputError
from tests.unit.test_kserve import BAD_REQUESTS

PAYLOAD = 16 * 1024 * 1024
CHUNK = 64 * 1024  # about what Serve's proxy hands over per ASGI message


def _request(n: int, binary_output: bool = True) -> tuple[bytes, list[bytes], int, np.ndarray]:
    """(header, the body in chunks, header length, the input) of a binary FP32 request of ``n`` floats."""
    x = np.random.default_rng(4).random((1, n), dtype=np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, n],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary_output}}],
        }
    ).encode()
    body = header + x.tobytes()
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
    return header, chunks, len(header), x


def _peak(fn: Callable[[], object]) -> tuple[int, object]:
    """Bytes Python allocated at the peak of ``fn()`` beyond what was allocated before, and its result."""
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base, result


def test_tracemalloc_sees_a_copy_of_the_payload() -> None:
    """The yardstick: copies by numpy and by bytes show up (so the tests below can fail)."""
    x = np.ones(PAYLOAD // 4, dtype=np.float32)
    assert _peak(lambda: np.array(x))[0] >= PAYLOAD
    assert _peak(lambda: x.tobytes())[0] >= PAYLOAD
    assert _peak(lambda: b"".join([b"h", x.view(np.uint8)]))[0] >= PAYLOAD


def test_a_binary_request_goes_from_its_chunks_into_the_slot_with_no_copy_of_ours() -> None:
    _, chunks, length, x = _request(PAYLOAD // 4)
    body_length = sum(len(c) for c in chunks)
    slot = np.zeros(x.size, dtype=np.float32)  # the leased slot's input buffer

    def decode_and_fill() -> kserve.DecodedRequest:
        async def run() -> kserve.DecodedRequest:
            async def stream():
                for chunk in chunks:
                    yield chunk
                yield b""

            it = stream().__aiter__()
            _, head, rest = await kserve_http._read_header(it, length)
            planned = kserve.plan_request(head, length, body_length)
            assert planned is not None
            decoded, spans = planned
            assert [(s.name, s.start, s.size) for s in spans] == [("INPUT0", length, x.nbytes)]
            scatter = kserve_http.Scatter([memoryview(slot.view(np.uint8))])
            scatter.feed(rest)
            async for chunk in it:
                scatter.feed(chunk)
            assert scatter.done
            return decoded

        return asyncio.run(run())

    extra, decoded = _peak(decode_and_fill)
    assert np.array_equal(slot, x.ravel())
    assert decoded.inputs["INPUT0"].shape == (1, x.size)
    assert decoded.inputs["INPUT0"].dtype == np.float32
    assert decoded.binary_outputs == {"OUTPUT0": True}
    assert extra < PAYLOAD // 8, f"{extra / PAYLOAD:.2f} payloads allocated: a copy of the body came back"


def test_the_answer_is_built_from_output_views_with_one_copy() -> None:
    _, chunks, length, x = _request(PAYLOAD // 4)
    decoded = kserve.decode_request(b"".join(chunks), length)
    slot = np.ascontiguousarray(x)
    slot.flags.writeable = False  # as the slot's output views are
    extra, (payload, headers) = _peak(lambda: kserve.encode_response("identity", decoded, {"OUTPUT0": slot}))
    assert extra < PAYLOAD + PAYLOAD // 8, f"{extra / PAYLOAD:.2f} payloads: more than the body's one copy"
    split = int(headers[kserve.HEADER_LENGTH])
    assert json.loads(payload[:split])["outputs"][0]["parameters"] == {"binary_data_size": x.nbytes}
    assert payload[split:] == x.tobytes()
    assert isinstance(payload, bytes)  # what Serve can pickle


@pytest.mark.parametrize(("data", "length"), [r[1:3] for r in BAD_REQUESTS], ids=[r[0] for r in BAD_REQUESTS])
def test_planning_refuses_what_decoding_refuses_with_the_same_error(data: bytes, length: int | None) -> None:
    length = len(data) if length is None else length  # a JSON-only body: its header is all of it
    with pytest.raises(InputError) as decoded:
        kserve.decode_request(data, length)
    with pytest.raises(InputError) as planned:
        kserve.plan_request(data[: min(length, len(data))], length, len(data))
    assert str(planned.value) == str(decoded.value)


def test_planning_matches_decoding_on_mixed_requests_and_leaves_bytes_data_to_decoding() -> None:
    ints = np.arange(4, dtype=np.int32)
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = json.dumps(
        {
            "id": "r1",
            "parameters": {"binary_data_output": True},
            "inputs": [
                {"name": "A", "datatype": "INT32", "shape": [4], "data": [0, 1, 2, 3]},
                {"name": "B", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
                {"name": "C", "datatype": "INT32", "shape": [4], "parameters": {"binary_data_size": 16}},
            ],
            "outputs": [{"name": "O"}, {"name": "P", "parameters": {"binary_data": False}}],
        }
    ).encode()
    body = header + floats.tobytes() + ints.tobytes()
    full = kserve.decode_request(body, len(header))
    planned = kserve.plan_request(header, len(header), len(body))
    assert planned is not None
    decoded, spans = planned
    assert [(s.name, s.start, s.size) for s in spans] == [("B", len(header), 24), ("C", len(header) + 24, 16)]
    assert (decoded.outputs, decoded.binary_outputs, decoded.default_binary, decoded.request_id) == (
        full.outputs,
        full.binary_outputs,
        full.default_binary,
        full.request_id,
    )
    for name, array in full.inputs.items():
        assert decoded.inputs[name].shape == array.shape and decoded.inputs[name].dtype == array.dtype
    assert np.array_equal(decoded.inputs["A"], ints)
    words = json.dumps(
        {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]}
    ).encode()
    assert kserve.plan_request(words, len(words), len(words) + 6) is None


def test_scatter_refuses_more_bytes_than_the_spans_hold() -> None:
    target = bytearray(8)
    scatter = kserve_http.Scatter([memoryview(target)[:5], memoryview(target)[5:]])
    scatter.feed(b"abc")
    scatter.feed(b"defgh")
    assert scatter.done and bytes(target) == b"abcdefgh"
    scatter.feed(b"")
    with pytest.raises(InputError, match="longer"):
        scatter.feed(b"i")
