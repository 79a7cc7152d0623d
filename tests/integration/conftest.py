"""Fixtures for integration tests against a real Triton server (no mocks).

* ``triton_server``: one embedded Triton per session serving ``deployments/models``.
* ``client``: a fresh :class:`TritonShmClient` per test (pools from :func:`default_pools`).
* ``make_client``: builds clients with other settings.
* ``shm_transport``: ``"http"`` or ``"grpc"``, how those clients send their shm
  requests; every test that uses a client runs with both.

Every client these fixtures hand out is closed after its test, and the test
fails if one of its slots is still busy or one of its segments is still in
/dev/shm afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "deployments" / "models"
# The models on the native C backend (native/rts_native.c), built by `make native`.
NATIVE_MODEL_REPOSITORY = REPO_ROOT / "deployments" / "native_models"
# Largest length of the variable dim of `identity` a slot of the default pools holds (float32 elements).
IDENTITY_MAX = 1 << 20
# Longest string element a slot of the default `strings` pool holds.
STRINGS_BOUND = 16


def default_pools() -> dict[str, PoolConfig]:
    """Pools of the ``client`` fixture: small slots for variable-size and BYTES models, one for ``sleep``."""
    return {
        "identity": PoolConfig(
            slots=2,
            max_batch_size=2,
            max_shapes={"INPUT0": (IDENTITY_MAX,), "OUTPUT0": (IDENTITY_MAX,)},
        ),
        # OUTPUT0 = 1 - 2 * INPUT0: outputs that differ from inputs, for the zero-copy and length tests.
        "affine": PoolConfig(
            slots=2,
            max_batch_size=2,
            max_shapes={"INPUT0": (IDENTITY_MAX,), "OUTPUT0": (IDENTITY_MAX,)},
        ),
        "whoami": PoolConfig(slots=1, max_batch_size=2, max_shapes={"INPUT0": (1024,), "OUTPUT0": (1024,)}),
        "sleep": PoolConfig(slots=1),
        # BYTES in and out: 4 strings per row of at most STRINGS_BOUND bytes; shm at every size.
        "strings": PoolConfig(
            slots=2,
            max_batch_size=2,
            max_shapes={"TEXT": (4,), "UPPER": (4,), "LENGTH": (4,)},
            max_element_bytes=STRINGS_BOUND,
            min_shm_bytes=0,
        ),
    }


def registered_regions(url: str) -> set[str]:
    """Names of the system shared-memory regions registered in the Triton at gRPC ``url``."""
    with grpcclient.InferenceServerClient(url) as raw:
        status = raw.get_system_shared_memory_status(as_json=True)
    return {region["name"] for region in status.get("regions", {}).values()}


def close_and_check(
    client: TritonShmClient, *, allow_pinned: bool = False, allow_quarantined: bool = False
) -> None:
    """Close ``client``; fail if a slot was still out or a segment or region of it survives the close.

    Out means busy, pinned (a view still alive) or quarantined (a request that may
    still run on the server); ``allow_*`` for a test that made one on purpose.
    """
    try:
        stats = client.pool_stats()
        regions = [client.pool(s.model).region_name for s in stats]
        out = [
            s
            for s in stats
            if s.busy or (s.quarantined and not allow_quarantined) or (s.pinned and not allow_pinned)
        ]
    finally:
        client.close()
    left = [name for name in regions if os.path.exists(os.path.join("/dev/shm", name))]
    assert not out, f"slots still busy, pinned or quarantined when the test ended: {out}"
    assert not left, f"segments left in /dev/shm after client.close(): {left}"
    try:
        registered = registered_regions(client.config.url) & set(regions)
    except InferenceServerException:  # the test stopped its server: nothing can be registered there
        registered = set()
    assert not registered, f"regions still registered in Triton after client.close(): {sorted(registered)}"


@pytest.fixture(scope="session")
def triton_server(session_lived_pids: set[int]) -> Iterator[TritonServer]:
    """The embedded Triton server on ``deployments/models``, shared by the whole session."""
    server = TritonServer(ServerConfig(model_repository=str(MODEL_REPOSITORY)))
    server.start()
    assert server.pid is not None
    session_lived_pids.add(server.pid)  # not a leak of the module that happened to start it
    try:
        yield server
    finally:
        server.stop()
    assert not server.is_alive()


@pytest.fixture(params=["http", "grpc"])
def shm_transport(request: pytest.FixtureRequest) -> str:
    """How the fixtures' clients send shared-memory requests (``ClientConfig.http_url`` set or not)."""
    return request.param


def transport_overrides(server: TritonServer, transport: str) -> dict[str, Any]:
    """ClientConfig fields that make a client of ``server`` send its shm requests over ``transport``."""
    return {"url": server.grpc_url, "http_url": server.http_url if transport == "http" else None}


@pytest.fixture
def make_client(triton_server: TritonServer, shm_transport: str) -> Iterator[Callable[..., TritonShmClient]]:
    """``make_client(**overrides)``: a client of ``triton_server`` with ClientConfig overrides."""
    made: list[TritonShmClient] = []

    def make(**overrides: Any) -> TritonShmClient:
        client = TritonShmClient(**{**transport_overrides(triton_server, shm_transport), **overrides})
        made.append(client)
        return client

    yield make
    failures = []
    for client in made:
        try:
            close_and_check(client)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


@pytest.fixture
def client(triton_server: TritonServer, shm_transport: str) -> Iterator[TritonShmClient]:
    """A client of ``triton_server`` with :func:`default_pools`, closed (and checked) after the test."""
    shm_client = TritonShmClient(**transport_overrides(triton_server, shm_transport), pools=default_pools())
    yield shm_client
    close_and_check(shm_client)
