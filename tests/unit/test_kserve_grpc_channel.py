"""The gRPC ingress's channel to Triton after Triton was down and is back (a real grpcio server, no Triton).

The ingress keeps one ``grpc.aio`` channel per Triton url. A call made while
Triton is down puts that channel in reconnect backoff; once Triton is back
the next call must be answered, not failed with "failed to connect to all
addresses" for seconds (see ``_private/triton/grpc_channel.py``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_grpc_channel import LiveServer, live_server  # noqa: F401  (the fixture)
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.ingress.kserve_grpc import KServeGrpcMixin
from ray_triton_shm._private.serve.protocol.kserve_grpc_routes import GrpcAnswerError
from ray_triton_shm._private.triton.grpc_channel import NEVER_SENT_PREFIX


class Ingress(KServeGrpcMixin):
    def __init__(self, url: str) -> None:
        self._client = SimpleNamespace(info=SimpleNamespace(grpc_url=url))


def test_the_first_call_after_triton_is_back_is_answered(live_server: LiveServer) -> None:  # noqa: F811
    ingress = Ingress(live_server.url)

    async def live() -> bool:
        answer = await ingress._call("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse, 5.0)
        return answer.live

    async def scenario() -> None:
        assert await live()
        first = ingress._channels[live_server.url]
        live_server.stop()
        with pytest.raises(GrpcAnswerError) as down:
            await live()
        assert down.value.code == "UNAVAILABLE" and NEVER_SENT_PREFIX in str(down.value)
        live_server.start()  # back at once: the channel is still in its first backoff (about 1 s)
        calls = live_server.calls
        assert await live()
        assert live_server.calls == calls + 1
        assert ingress._channels[live_server.url] is not first  # replaced, once
        for channel in ingress._channels.values():
            await channel.close()

    asyncio.run(scenario())


def test_while_triton_is_down_the_error_stays_and_no_channel_piles_up(live_server: LiveServer) -> None:  # noqa: F811
    ingress = Ingress(live_server.url)

    async def scenario() -> None:
        live_server.stop()
        for _ in range(3):
            with pytest.raises(GrpcAnswerError) as down:
                await ingress._call("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse, 5.0)
            assert down.value.code == "UNAVAILABLE"
        assert len(ingress._channels) == 1
        for channel in ingress._channels.values():
            await channel.close()

    asyncio.run(scenario())
