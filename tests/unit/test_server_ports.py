"""The ports a TritonServer gives Triton: each endpoint its own, and a clash is retried."""

from __future__ import annotations

import itertools
import socket

import pytest

from ray_triton_shm import ServerConfig, TritonServer, server
from ray_triton_shm._private.triton import server_launch

FIRST_PORT = 41000


class _Kernel:
    """Hands out ports for ``bind((host, 0))`` as Linux may: any port not bound at that moment.

    This one always offers the lowest such port, so a port that was bound and
    let go is handed out again at once (Linux does so at random, now and then).
    """

    def __init__(self) -> None:
        self.bound: set[int] = set()

    def socket(self, *args: object, **kwargs: object) -> _Socket:
        return _Socket(self)


class _Socket:
    def __init__(self, kernel: _Kernel) -> None:
        self._kernel = kernel
        self._port: int | None = None

    def bind(self, address: tuple[str, int]) -> None:
        port = address[1] or next(p for p in itertools.count(FIRST_PORT) if p not in self._kernel.bound)
        if port in self._kernel.bound:
            raise OSError(98, "Address already in use")
        self._kernel.bound.add(port)
        self._port = port

    def getsockname(self) -> tuple[str, int]:
        assert self._port is not None
        return ("127.0.0.1", self._port)

    def setsockopt(self, *args: object) -> None:
        pass

    def close(self) -> None:
        if self._port is not None:
            self._kernel.bound.discard(self._port)
            self._port = None

    def __enter__(self) -> _Socket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    fake = _Kernel()
    monkeypatch.setattr(server_launch.socket, "socket", fake.socket)
    return fake


def _server(**ports: int) -> TritonServer:
    return TritonServer(ServerConfig(model_repository="/nonexistent/models", **ports))


def _ports(config: ServerConfig) -> tuple[int, int, int]:
    return (config.http_port, config.grpc_port, config.metrics_port)


def test_free_ports_differ_even_when_the_kernel_would_hand_one_out_twice(kernel: _Kernel) -> None:
    resolved = _ports(_server()._resolve_ports(fresh=True))
    assert len(set(resolved)) == 3, resolved
    assert not kernel.bound  # nothing stays bound: Triton binds them next


def test_a_free_port_is_never_one_the_config_names(kernel: _Kernel) -> None:
    resolved = _ports(_server(http_port=FIRST_PORT)._resolve_ports(fresh=True))
    assert resolved[0] == FIRST_PORT and len(set(resolved)) == 3, resolved


def test_a_clash_of_endpoints_is_retried_on_fresh_ports() -> None:
    # What Triton says when two of its endpoints got the same port.
    tail = "The server cannot listen to HTTP requests and metrics requests at the same address and port"
    assert server_launch.ports_clashed(tail)
    assert server_launch.ports_clashed("failed to start HTTP service: Address already in use")
    assert not server_launch.ports_clashed("failed to load model 'x'")


def test_the_public_server_module_names_the_port_and_header_helpers() -> None:
    for name in ("free_ports", "ports_clashed", "SHM_API_HEADER", "SHM_API_GRPC_HEADER"):
        assert getattr(server, name) is getattr(server_launch, name)


def test_the_real_kernel_gives_three_distinct_ports() -> None:
    resolved = _ports(_server()._resolve_ports(fresh=True))
    assert len(set(resolved)) == 3 and all(resolved), resolved
    for port in resolved:  # and lets go of them
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
