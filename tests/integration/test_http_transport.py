"""Shared-memory requests over Triton's HTTP endpoint (``ClientConfig.http_url``), against a real Triton."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ray_triton_shm import ServerConfig, TritonServer, TritonShmClient
from ray_triton_shm.errors import UnavailableError

from .conftest import MODEL_REPOSITORY, close_and_check, transport_overrides
from .footprint import ESTABLISHED, fd_targets, socket_inode, tcp_peers


def _add_sub(client: TritonShmClient, value: int) -> None:
    a = np.full((2, 16), value, np.int32)
    b = np.arange(32, dtype=np.int32).reshape(2, 16)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
    assert out.path == "shm"
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def _all_free(client: TritonShmClient, model: str) -> bool:
    stats = client.pool(model).stats()
    return stats.busy == 0 and stats.free == stats.slots


def _established_to(port: int) -> int:
    """How many of this process's TCP sockets are connected to ``port``."""
    peers = tcp_peers(os.getpid())
    inodes = (socket_inode(target) for target in fd_targets(os.getpid()))
    return sum(peers.get(inode) == (port, ESTABLISHED) for inode in inodes if inode is not None)


@pytest.fixture(scope="module")
def own_server() -> Iterator[TritonServer]:
    """A server this module stops and restarts (the session one is not)."""
    server = TritonServer(ServerConfig(model_repository=str(MODEL_REPOSITORY), load_models=("add_sub",)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_shm_requests_travel_on_the_http_endpoint(triton_server: TritonServer) -> None:
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
    client = TritonShmClient(url=triton_server.grpc_url, http_url=nowhere)
    try:
        a = np.ones((2, 16), np.int32)
        with pytest.raises(UnavailableError, match="cannot reach Triton") as info:
            client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        assert info.value.status == "UNAVAILABLE" and info.value.model == "add_sub"
        assert _all_free(client, "add_sub")
        # Registration and plain gRPC use `url`, which is fine.
        out = client.infer_grpc("add_sub", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
    finally:
        close_and_check(client)


def test_keep_alive_connections_are_reused_and_closed_with_the_client(triton_server: TritonServer) -> None:
    port = int(triton_server.http_url.rsplit(":", 1)[1])
    before = _established_to(port)
    client = TritonShmClient(**transport_overrides(triton_server, "http"))
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(25):
                _add_sub(client, base + i)
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=work, args=(100 * k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        # 100 requests from 4 threads: at most one connection per concurrent caller.
        assert 1 <= _established_to(port) - before <= 4
    finally:
        close_and_check(client)
    assert _established_to(port) == before


def test_stopped_server_raises_unavailable_and_a_restarted_one_serves_again(
    own_server: TritonServer, shm_transport: str
) -> None:
    client = TritonShmClient(**transport_overrides(own_server, shm_transport))
    try:
        _add_sub(client, 1)
        own_server.stop()
        with pytest.raises(UnavailableError) as info:
            _add_sub(client, 2)
        assert info.value.model == "add_sub"
        assert _all_free(client, "add_sub")
        # Same ports. HTTP finds its kept connection dead and the region forgotten and
        # recovers at once; a gRPC channel may still be in its reconnect backoff.
        own_server.restart()
        deadline = time.monotonic() + (0 if shm_transport == "http" else 10)
        while True:
            try:
                _add_sub(client, 3)
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert _all_free(client, "add_sub")
    finally:
        close_and_check(client)
