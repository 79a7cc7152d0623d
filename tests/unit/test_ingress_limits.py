"""The ingress's limits without a server: body size, inflation, what error answers say, the version cache."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest
from starlette.requests import Request

from ray_triton_shm._private.node import node_config
from ray_triton_shm._private.serve.ingress import kserve_http
from ray_triton_shm._private.serve.net import bounded
from ray_triton_shm._private.serve.protocol import kserve_errors, kserve_limits
from ray_triton_shm._private.serve.protocol.grpc_messages import status_of
from ray_triton_shm.errors import (
    ConfigError,
    InputError,
    PoolTimeoutError,
    RequestTooLargeError,
    TritonCallError,
    UnavailableError,
)

LIMIT = 1 << 20


def _request(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A Starlette request whose body arrives as ``chunks``; the list counts the chunks read."""
    read = [0]
    pending = list(chunks)

    async def receive() -> dict:
        if not pending:
            return {"type": "http.request", "body": b"", "more_body": False}
        read[0] += 1
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/infer",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive), read


def _body(chunks: list[bytes], headers: dict[str, str], limit: int = LIMIT) -> bytes:
    request, _ = _request(chunks, headers)
    return asyncio.run(kserve_http.request_body(request, max_bytes=limit))


# -- body size (finding: no limit, bombs inflated) ------------------------------------------------


def test_a_content_length_past_the_limit_is_refused_before_reading() -> None:
    request, read = _request([b"{}"], {"content-length": str(10**12)})
    with pytest.raises(RequestTooLargeError) as info:
        asyncio.run(kserve_http.request_body(request, max_bytes=LIMIT))
    assert read == [0]
    assert kserve_errors.http_status(info.value) == 413
    assert "exceeds the maximum allowed" in kserve_errors.error_message(info.value)


def test_a_streamed_body_past_the_limit_is_refused_once_it_passes() -> None:
    chunks = [b"x" * (LIMIT // 4)] * 8
    request, read = _request(chunks, {})  # chunked: no Content-Length
    with pytest.raises(RequestTooLargeError):
        asyncio.run(kserve_http.request_body(request, max_bytes=LIMIT))
    assert read[0] <= 5  # stopped once past the limit, not at the end
    assert _body([b"x" * (LIMIT // 2)] * 2, {}) == b"x" * LIMIT  # exactly the limit is fine


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_inflation_stops_at_the_limit(encoding: str) -> None:
    plain = b" " * (LIMIT + 1)
    packed = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    with pytest.raises(RequestTooLargeError, match="exceeds the maximum allowed"):
        _body([packed], {"content-encoding": encoding})
    fits = plain[:LIMIT]
    packed = gzip.compress(fits) if encoding == "gzip" else zlib.compress(fits)
    assert _body([packed[:100], packed[100:]], {"content-encoding": encoding}) == fits


def test_inflation_is_bounded_in_memory() -> None:
    """A 256 MiB bomb (about 1 MB compressed) is refused after inflating about the limit, not 256 MiB."""
    import tracemalloc

    deflater = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * (1 << 24)
    bomb = b"".join([deflater.compress(block) for _ in range(16)]) + deflater.flush()
    assert len(bomb) < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(RequestTooLargeError):
            bounded.inflate(bomb, "gzip", LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(bomb) + 4 * LIMIT, peak


def test_a_bad_encoding_or_data_is_still_a_400() -> None:
    with pytest.raises(InputError, match="unsupported Content-Encoding") as info:
        _body([b"x"], {"content-encoding": "br"})
    assert kserve_errors.http_status(info.value) == 400
    with pytest.raises(InputError, match="not valid gzip") as info:
        _body([b"not gzip"], {"content-encoding": "gzip"})
    assert not isinstance(info.value, RequestTooLargeError)


def test_max_request_bytes_is_a_validated_node_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_triton_shm.config import ServerConfig
    from ray_triton_shm.node import NodeConfig

    server = ServerConfig(model_repository="unused")
    monkeypatch.delenv("RAY_TRITON_SHM_MAX_REQUEST_BYTES", raising=False)
    assert NodeConfig(server=server).max_request_bytes == 1 << 26 == node_config.MAX_REQUEST_BYTES
    monkeypatch.setenv("RAY_TRITON_SHM_MAX_REQUEST_BYTES", "1048576")
    assert NodeConfig(server=server).max_request_bytes == 1 << 20
    assert NodeConfig(server=server, max_request_bytes=5).max_request_bytes == 5  # explicit wins
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ConfigError, match="max_request_bytes"):
            NodeConfig(server=server, max_request_bytes=bad)
    monkeypatch.setenv("RAY_TRITON_SHM_MAX_REQUEST_BYTES", "lots")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_MAX_REQUEST_BYTES"):
        NodeConfig(server=server)
    # A client-side setting: nodes that differ only in it share a Triton.
    monkeypatch.delenv("RAY_TRITON_SHM_MAX_REQUEST_BYTES")
    assert (
        NodeConfig(server=server, max_request_bytes=1).fingerprint()
        == NodeConfig(server=server).fingerprint()
    )


# -- error answers say nothing internal -----------------------------------------------------------

NODE_ID = "a3f" * 18 + "bc"
LEAKY = [
    UnavailableError(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:41234: "
        "Failed to connect to remote host: Connection refused",
        "UNAVAILABLE",
        "m",
    ),
    UnavailableError(
        "cannot reach Triton at 127.0.0.1:41235: [Errno 111] Connection refused", "UNAVAILABLE", "m"
    ),
    UnavailableError(f"Triton on node {NODE_ID} is restarting; try again shortly", "UNAVAILABLE"),
    UnavailableError(f"the node actor of {NODE_ID} is shutting down (no users left)"),
    PoolTimeoutError("m", 5.0, "of 2 slots: 2 in use by this process, 0 kept by live output views"),
    TritonCallError("unreadable answer from Triton at [::1]:8000: bad status line", None, "m"),
    TritonCallError("Socket closed (ipv6:[::1]:41234)", "INTERNAL", "m"),
]


@pytest.mark.parametrize("error", LEAKY, ids=lambda e: type(e).__name__)
def test_error_answers_name_no_address_node_or_pool_state(error: Exception, caplog) -> None:
    code = kserve_errors.http_status(error)
    texts = [kserve_errors.error_message(error), status_of(error)[1]]
    for text in texts:
        for leak in ("127.0.0.1", "::1", "ipv4:", "ipv6:", NODE_ID, "slots:", "in use by"):
            assert leak not in text, (leak, text)
        assert text
    # The status keeps its kind: unavailable stays 503 / UNAVAILABLE.
    if isinstance(error, (UnavailableError, PoolTimeoutError)):
        assert code == 503 and status_of(error)[0] == "UNAVAILABLE"
    if isinstance(error, PoolTimeoutError):
        assert "no shared-memory slot of model 'm'" in texts[0]


def test_tritons_own_refusals_keep_their_text() -> None:
    error = TritonCallError("Request for unknown model: 'x' is not found", "NOT_FOUND", "x")
    assert kserve_errors.error_message(error) == status_of(error)[1] == error.message
    unavailable = TritonCallError("Request for unknown model: 'x' has no available versions", "UNAVAILABLE")
    assert kserve_errors.error_message(unavailable) == unavailable.message


# -- the version cache ------------------------------------------------------------------------------


def test_the_version_cache_is_bounded_and_skips_unknown_models(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray_triton_shm.serve as serve_module
    from ray_triton_shm._private.serve.protocol import kserve_routes

    asked: list[str] = []

    def fake_triton_http(url, method, path, body, headers, timeout):
        asked.append(path)
        if path.startswith("/v2/models/known"):
            return 200, b'{"name": "known", "versions": ["1", "3"]}', {}
        return 404, b'{"error": "Request for unknown model"}', {}

    monkeypatch.setattr(kserve_routes, "triton_http", fake_triton_http)
    deployment = object.__new__(serve_module.TritonDeployment.func_or_class)
    deployment._client = type("C", (), {"info": type("I", (), {"http_url": "127.0.0.1:1"})()})()
    deployment._versions = kserve_limits.VersionCache()

    async def run() -> None:
        for i in range(5000):
            assert await deployment._served_version(f"nope-{i}") == "1"
        assert await deployment._served_version("known-0") == "3"
        asked.clear()
        assert await deployment._served_version("known-0") == "3"  # cached
        assert not asked

    asyncio.run(run())
    assert len(deployment._versions) <= kserve_limits.VERSION_CACHE_SIZE
    assert all(not name.startswith("nope-") for name in deployment._versions)
