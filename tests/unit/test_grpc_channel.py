"""TritonGrpc against a real gRPC server (grpcio, in this process) that goes down and comes back.

What is under test is gRPC's channel, not Triton: a channel that tried to
connect while its server was down keeps failing calls (reconnect backoff)
after the server is back. The server here answers Triton's ``ServerLive``
RPC, the one call these tests make.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.triton.grpc_channel import (
    TritonGrpc,
    accepts_connections,
    channel_options,
    never_sent,
    split_host_port,
    unregister_region,
)
from ray_triton_shm.errors import PoolClosedError
from tests.helpers import free_port

SERVICE = "inference.GRPCInferenceService"


class LiveServer:
    """A gRPC server on a fixed port answering ``ServerLive``; stop() and start() again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.calls = 0
        self._server: grpc.Server | None = None

    def _live(
        self, request: service_pb2.ServerLiveRequest, context: object
    ) -> service_pb2.ServerLiveResponse:
        self.calls += 1
        return service_pb2.ServerLiveResponse(live=True)

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._live,
            request_deserializer=service_pb2.ServerLiveRequest.FromString,
            response_serializer=service_pb2.ServerLiveResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"ServerLive": handler})]
        )
        assert server.add_insecure_port(self.url) == self.port
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None


@pytest.fixture
def live_server() -> Iterator[LiveServer]:
    server = LiveServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _down_then_back(server: LiveServer, call: object) -> None:
    """Stop ``server``, have ``call`` fail while it is down (its channel starts backing off), start it."""
    server.stop()
    with pytest.raises(InferenceServerException) as failed:
        call()  # type: ignore[operator]
    assert never_sent(failed.value), failed.value
    # Back at once: the channel waits out its first reconnect backoff (0.8 to 1.2 s) before trying again.
    server.start()


def test_a_call_right_after_the_server_is_back_is_answered(live_server: LiveServer) -> None:
    client = TritonGrpc(live_server.url)
    try:
        assert client.is_server_live()
        _down_then_back(live_server, client.is_server_live)
        assert client.replaced == 0  # while down, nothing to gain from a new channel
        assert client.is_server_live()
        assert client.replaced == 1
        assert client.is_server_live() and client.replaced == 1
    finally:
        client.close()


def test_a_plain_channel_fails_right_after_the_server_is_back(live_server: LiveServer) -> None:
    """What TritonGrpc is for: the same sequence fails on tritonclient's own client (the bug it fixes)."""
    client = grpcclient.InferenceServerClient(live_server.url)
    try:
        assert client.is_server_live()
        _down_then_back(live_server, client.is_server_live)
        with pytest.raises(InferenceServerException) as failed:
            client.is_server_live()
        assert never_sent(failed.value), failed.value
        # And a new client of the same server inherits the backoff (the global subchannel pool) ...
        with (
            grpcclient.InferenceServerClient(live_server.url) as fresh,
            pytest.raises(InferenceServerException),
        ):
            fresh.is_server_live()
        # ... which a channel with its own subchannels does not.
        with grpcclient.InferenceServerClient(live_server.url, channel_args=channel_options()) as own:
            assert own.is_server_live()
    finally:
        client.close()


def test_while_the_server_is_down_calls_fail_fast_and_keep_the_channel(live_server: LiveServer) -> None:
    client = TritonGrpc(live_server.url)
    try:
        assert client.is_server_live()
        first = client.client
        live_server.stop()
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(InferenceServerException) as failed:
                client.is_server_live()
            assert time.monotonic() - started < 5.0
            assert never_sent(failed.value)
        assert client.client is first and client.replaced == 0
    finally:
        client.close()


def test_closed_client_refuses_calls_and_never_replaces_its_channel(live_server: LiveServer) -> None:
    client = TritonGrpc(live_server.url)
    assert client.is_server_live()
    client.close()
    client.close()  # idempotent
    with pytest.raises(PoolClosedError, match="is closed"):  # typed: the node's callers answer 503
        client.is_server_live()
    assert client.replaced == 0


def test_a_call_on_a_channel_replaced_under_it_goes_to_the_new_one(live_server: LiveServer) -> None:
    """Another thread replaced (and closed) the channel between this call's read of it and the call."""
    client = TritonGrpc(live_server.url)
    try:
        stale = client.client
        assert client._replace(stale) is True  # the server accepts connections: replaced
        assert client.client is not stale and client.replaced == 1
        with pytest.raises(ValueError):
            stale.is_server_live()
        calls = live_server.calls
        assert client.call("is_server_live")
        assert live_server.calls == calls + 1
    finally:
        client.close()


def test_only_public_client_methods_are_offered() -> None:
    client = TritonGrpc("127.0.0.1:1")
    try:
        assert callable(client.get_model_config)
        with pytest.raises(AttributeError):
            client.no_such_method  # noqa: B018
        with pytest.raises(AttributeError):
            client._channel  # noqa: B018
    finally:
        client.close()


def _error(status: str, message: str) -> InferenceServerException:
    return InferenceServerException(msg=message, status=f"StatusCode.{status}")


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        (
            "UNAVAILABLE",
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: refused",
            True,
        ),
        ("UNAVAILABLE", "Stream removed (Socket closed)", False),  # cut off after it was sent
        ("UNAVAILABLE", "Connection reset by peer", False),
        ("DEADLINE_EXCEEDED", "failed to connect to all addresses", False),
        ("NOT_FOUND", "Unable to find system shared memory region", False),
    ],
)
def test_never_sent_only_for_a_failed_pick(status: str, message: str, expected: bool) -> None:
    assert never_sent(_error(status, message)) is expected


def test_split_host_port_and_probe() -> None:
    assert split_host_port("127.0.0.1:8001") == ("127.0.0.1", 8001)
    assert split_host_port("[::1]:8001") == ("::1", 8001)
    assert split_host_port("localhost:x") is None
    assert split_host_port("localhost") is None
    assert not accepts_connections("no-port")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"127.0.0.1:{listener.getsockname()[1]}"
        assert accepts_connections(url)
    assert not accepts_connections(url)


class _Regions:
    """Answers unregister calls as Triton does for a region its last request still holds ``busy`` times."""

    def __init__(self, busy: int, message: str = "it is currently in use") -> None:
        self.busy = busy
        self.message = message
        self.calls: list[tuple[str, str, dict]] = []

    def _unregister(self, kind: str, name: str, **kwargs) -> None:
        self.calls.append((kind, name, kwargs))
        if self.busy:
            self.busy -= 1
            raise InferenceServerException(f"Cannot unregister shared memory region '{name}', {self.message}")

    def unregister_system_shared_memory(self, name: str, **kwargs) -> None:
        self._unregister("system", name, **kwargs)

    def unregister_cuda_shared_memory(self, name: str, **kwargs) -> None:
        self._unregister("cuda", name, **kwargs)


@pytest.mark.parametrize("cuda", [False, True])
def test_a_region_still_in_use_is_unregistered_once_triton_lets_go(cuda: bool) -> None:
    regions = _Regions(busy=3)
    unregister_region(regions, "r", cuda, 5.0, headers={"a": "b"})
    kind = "cuda" if cuda else "system"
    assert regions.calls == [(kind, "r", {"headers": {"a": "b"}})] * 4


def test_a_region_in_use_past_the_wait_or_another_refusal_is_raised() -> None:
    regions = _Regions(busy=1000)
    start = time.monotonic()
    with pytest.raises(InferenceServerException, match="in use"):
        unregister_region(regions, "r", False, 0.3)
    assert 0.3 <= time.monotonic() - start < 5 and len(regions.calls) > 1
    other = _Regions(busy=1, message="it does not exist")
    with pytest.raises(InferenceServerException, match="does not exist"):
        unregister_region(other, "r", False, 5.0)
    assert len(other.calls) == 1
