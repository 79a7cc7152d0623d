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
import os
import tracemalloc
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.requests import Request

from ray_triton_shm._private.serve.ingress import kserve_http
from ray_triton_shm._private.serve.protocol import kserve
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm.errors import InputError
from tests.unit.conftest import shm_path
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


class _Triton:
    """Stands in for the node's Triton (a unit test: no server): the identity, run in the slot."""

    def __init__(self, pool: SlotPool) -> None:
        from ray_triton_shm.client import TritonShmClient
        from ray_triton_shm.config import PoolConfig

        self._pool = pool
        self._recheck = False
        self.runs = 0
        self.client = SimpleNamespace(
            _layout_or_none=lambda model: pool.layout,
            _pools={"identity": pool},
            pool=lambda model: pool,
            _wanted_outputs=TritonShmClient._wanted_outputs,
            config=SimpleNamespace(pool_for=lambda model: PoolConfig()),
            _http=None,
        )

    async def alease(self, model: str) -> Lease:
        return await self._pool.acquire_async(5.0)

    async def arun(self, lease: Lease, outputs: list[str] | None) -> dict[str, np.ndarray]:
        self.runs += 1
        shape = lease.input_shapes["INPUT0"]
        spec = lease.layout.output("OUTPUT0")
        np.copyto(lease._array(spec, shape), lease.input("INPUT0", shape))  # Triton writes the output
        return {"OUTPUT0": lease.output("OUTPUT0", shape)}

    async def ainfer(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the general path ran: the body was read whole")


def _asgi_request(chunks: list[bytes], headers: dict[str, str]) -> Request:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/identity/infer",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive)


def test_the_whole_http_inference_makes_one_copy_each_way(identity_config: dict) -> None:
    """Chunks -> slot (no copy of ours beyond that), slot -> body (the one copy), the slot given back."""
    from ray_triton_shm._private.shm.layout import layout_from_config
    from ray_triton_shm.config import PoolConfig

    n = PAYLOAD // 4
    identity_config["input"][0]["dims"] = ["-1"]
    identity_config["output"][0]["dims"] = ["-1"]
    layout = layout_from_config(
        identity_config, PoolConfig(max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    )
    pool = SlotPool.create(layout, 1)
    try:
        _, chunks, length, x = _request(n)
        headers = {
            "content-length": str(sum(map(len, chunks))),
            "inference-header-content-length": str(length),
        }
        triton = _Triton(pool)

        async def version(model: str) -> str:
            return "1"

        extra, response = _peak(
            lambda: asyncio.run(
                kserve_http.http_infer(triton, "identity", _asgi_request(chunks, headers), version)
            )
        )
        assert triton.runs == 1
        split = int(response.headers[kserve.HEADER_LENGTH])
        answer = json.loads(response.body[:split])
        assert answer["outputs"] == [
            {
                "name": "OUTPUT0",
                "datatype": "FP32",
                "shape": [1, n],
                "parameters": {"binary_data_size": x.nbytes},
            }
        ]
        assert response.body[split:] == x.tobytes()
        assert extra < PAYLOAD + PAYLOAD // 4, f"{extra / PAYLOAD:.2f} payloads: a copy of ours came back"
        del response
        gc.collect()
        assert pool.stats().busy == 0  # the slot went back
    finally:
        pool.close()
    assert not os.path.exists(shm_path(pool.region_name))
