"""The KServe v2 HTTP ingress in the benchmark: ours (shm behind), the same app over gRPC, Triton straight.

Three rows, every one an unmodified ``tritonclient.http`` client sending a
binary FP32 request and asking for a binary output:

* ``ingress-http``: Serve's HTTP proxy -> :class:`~ray_triton_shm.serve.TritonDeployment`
  -> a shared-memory slot -> Triton;
* ``ingress-http-grpc``: the same proxy and the same replica code (decoding, answer
  encoding), but the replica calls Triton with ``tritonclient.grpc`` (the fair comparison:
  what the app costs without shared memory behind it);
* ``triton-http``: ``tritonclient.http`` straight to Triton's own HTTP endpoint.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ray_triton_shm._private.bench.core_methods import Caller, Cell, check_equal
from ray_triton_shm._private.serve.protocol import kserve
from ray_triton_shm.serve import TritonDeployment

HTTP_METHODS = ("ingress-http", "ingress-http-grpc", "triton-http")
ROUTES = {"ingress-http": "/bench-ours", "ingress-http-grpc": "/bench-http-grpc"}


class _GrpcBehind(TritonDeployment.func_or_class):  # type: ignore[name-defined,misc]
    """:class:`TritonDeployment` whose KServe HTTP inference calls Triton over plain gRPC."""

    async def _http_infer(self, model: str, request: Request) -> Response:
        body = await request.body()
        header_length = kserve.parse_header_length(request.headers.get(kserve.HEADER_LENGTH))
        decoded = kserve.decode_request(body, header_length)
        version = await self._served_version(model)
        outputs = await asyncio.to_thread(self._client.infer_grpc, model, decoded.inputs)
        wanted = {name: outputs[name] for name in decoded.outputs or outputs}
        payload, headers = kserve.encode_response(model, decoded, wanted, version)
        return Response(payload, headers=headers)


GrpcBehindDeployment = serve.deployment(
    _GrpcBehind, name="BenchHttpGrpc", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32
)


def start_grpc_behind(node_config: Any) -> str:
    """Deploy the gRPC-behind variant of the app (Serve must be started); its route prefix."""
    serve.run(
        GrpcBehindDeployment.bind(node_config, 4),
        name="bench-http-grpc",
        route_prefix=ROUTES["ingress-http-grpc"],
    )
    return ROUTES["ingress-http-grpc"]


def http_cell(method: str, url: str, inputs: list[np.ndarray], model: str) -> Cell:
    """Callers of an unmodified ``tritonclient.http`` client at ``url`` (``host:port[/prefix]``).

    Inputs go as binary tensor data, the output is asked for in binary.
    """
    cell = Cell([], paths={"http"})

    def caller(x: np.ndarray) -> Caller:
        client = httpclient.InferenceServerClient(url, connection_timeout=120, network_timeout=120)
        cell.closers.append(client.close)
        requested = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]

        def call(check: bool) -> object:
            tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            out = client.infer(model, [tensor], outputs=requested).as_numpy("OUTPUT0")
            if check:
                check_equal(method, out, x)
            return out

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell
