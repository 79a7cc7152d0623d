"""The Ray methods: Serve handle and Ray Data ``map_batches``, ours vs plain gRPC.

Both sides use the node actor's Triton (the one the core methods use too);
the plain sides are what a user would write without this package: a Serve
deployment and a Data predictor calling ``tritonclient.grpc``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import tritonclient.grpc as grpcclient
from ray import serve

from ray_triton_shm._private.bench import http_ingress
from ray_triton_shm._private.bench.core_methods import Caller, Cell, OutputMismatch, check_equal
from ray_triton_shm._private.bench.slotref_methods import SlotRefTarget, slotref_cell
from ray_triton_shm._private.serve.ingress.kserve_grpc import SERVICER_FUNCTION
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON
from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.data import TritonPredictor
from ray_triton_shm.serve import TritonDeployment

SERVE_MODEL = "identity"
DATA_MODEL = "multi_io"
IMAGE_SHAPE = (3, 224, 224)
ROW_BYTES = int(np.prod(IMAGE_SHAPE)) * 4 + 10 * 4


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class PlainGrpcDeployment:
    """What users write without this package: a replica calling Triton over gRPC."""

    def __init__(self, grpc_url: str) -> None:
        self._url = grpc_url
        self._local = threading.local()

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = grpcclient.InferenceServerClient(self._url)
        return client

    def _infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), NUMPY_TO_TRITON[array.dtype])
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        response = self._client().infer(model, tensors)
        return {out["name"]: response.as_numpy(out["name"]) for out in response.get_response(True)["outputs"]}

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return await asyncio.to_thread(self._infer, model, inputs)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class EchoDeployment:
    """Reference: the handle round trip of the same payload, no Triton at all."""

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": inputs["INPUT0"]}


def start_serve_apps(node_config: Any, grpc_url: str, http_url: str | None = None) -> dict[str, Any]:
    """Deploy our deployment and the plain one, and Serve's gRPC proxy with our KServe v2 ingress.

    Returns:
        Method name -> a deployment handle (handle cells; ``serve-slotref``'s with the
        node config to lease from, see :mod:`.slotref_methods`), or an address: a gRPC one
        (``tritonclient.grpc`` cells): ``ingress-grpc`` is Serve's gRPC proxy in
        front of ``serve-ours``, ``triton-grpc`` the same Triton straight; an HTTP one
        (``tritonclient.http`` cells, see :mod:`~ray_triton_shm._private.bench.http_ingress`):
        ``ingress-http`` is Serve's HTTP proxy in front of ``serve-ours``,
        ``ingress-http-grpc`` the same app calling Triton over gRPC, ``triton-http``
        Triton's own HTTP endpoint (with ``http_url``).
    """
    ports = free_ports("127.0.0.1", 2)
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": "127.0.0.1", "port": ports[0]},
        grpc_options={"port": ports[1], "grpc_servicer_functions": [SERVICER_FUNCTION]},
    )
    ours = serve.run(
        TritonDeployment.options(name="BenchOurs").bind(node_config, 4),
        name="bench-ours",
        route_prefix="/bench-ours",
    )
    plain = serve.run(
        PlainGrpcDeployment.options(name="BenchPlain").bind(grpc_url), name="bench-plain", route_prefix=None
    )
    echo = serve.run(EchoDeployment.options(name="BenchEcho").bind(), name="bench-echo", route_prefix=None)
    http_grpc = http_ingress.start_grpc_behind(node_config)
    http = {
        "ingress-http": f"127.0.0.1:{ports[0]}/bench-ours",
        "ingress-http-grpc": f"127.0.0.1:{ports[0]}{http_grpc}",
    }
    if http_url:
        http["triton-http"] = http_url
    return {
        **http,
        "serve-ours": ours,
        "serve-slotref": SlotRefTarget(ours, node_config),
        "serve-grpc": plain,
        "serve-echo": echo,
        "ingress-grpc": f"127.0.0.1:{ports[1]}",
        "triton-grpc": grpc_url,
    }


def grpc_ingress_cell(
    method: str, url: str, inputs: list[np.ndarray], model: str = SERVE_MODEL, application: str | None = None
) -> Cell:
    """Callers of an unmodified ``tritonclient.grpc`` client, one per caller, at ``url``.

    Args:
        method: The cell's name (in check failures).
        url: Serve's gRPC proxy (with ``application``) or Triton's own endpoint.
        inputs: One input per caller.
        model: An identity model.
        application: The ``application`` metadata header selecting the Serve app.
    """
    cell = Cell([], paths={"grpc"})
    headers = {"application": application} if application else None

    def caller(x: np.ndarray) -> Caller:
        client = grpcclient.InferenceServerClient(url)
        cell.closers.append(client.close)
        requested = [grpcclient.InferRequestedOutput("OUTPUT0")]

        def call(check: bool) -> object:
            tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            out = client.infer(model, [tensor], outputs=requested, headers=headers).as_numpy("OUTPUT0")
            if check:
                check_equal(method, out, x)
            return out

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


def serve_cell(method: str, handle: Any, inputs: list[np.ndarray], model: str = SERVE_MODEL) -> Cell:
    """Callers of one Serve handle, each sending its own input to ``model`` (an identity)."""
    if isinstance(handle, SlotRefTarget):
        return slotref_cell(method, handle, inputs, model)

    def caller(x: np.ndarray) -> Caller:
        def call(check: bool) -> object:
            out = handle.infer.remote(model, {"INPUT0": x}).result()["OUTPUT0"]
            if check:
                check_equal(method, out, x)
            return out

        return call

    return Cell([caller(x) for x in inputs], paths={"handle"})


# -- Ray Data ------------------------------------------------------------------
def make_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Image-sized rows derived from their ids, so any row can be checked."""
    ids = batch["id"].astype(np.int64)
    grid = np.arange(int(np.prod(IMAGE_SHAPE)), dtype=np.float32).reshape(IMAGE_SHAPE) / 1e5
    images = grid[None] + (ids % 97).astype(np.float32)[:, None, None, None]
    ints = (ids[:, None] * 10 + np.arange(10)[None]).astype(np.int32)
    return {"id": ids, "INPUT0": images.astype(np.float32), "INPUT1": ints}


def expected_outputs(row_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``multi_io``'s outputs for the row made from ``row_id`` (numpy's sums)."""
    row = make_rows({"id": np.array([row_id])})
    image, ints = row["INPUT0"][0], row["INPUT1"][0]
    return image.reshape(512, 294).sum(-1, dtype=np.float32), ints.reshape(5, 2).sum(-1, dtype=np.int32)


def check_data_batch(method: str, batch: dict[str, np.ndarray]) -> None:
    """Outputs of ``multi_io`` for the batch's rows (first and last row checked)."""
    for row in {0, len(batch["id"]) - 1}:
        want0, want1 = expected_outputs(int(batch["id"][row]))
        got0, got1 = batch["OUTPUT0"][row], batch["OUTPUT1"][row]
        if not (np.allclose(got0, want0, rtol=1e-4) and np.array_equal(got1, want1)):
            raise OutputMismatch(f"{method}: multi_io outputs differ from numpy's")


def _without_inputs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # An inference pipeline keeps ids and predictions, not the images: not
    # writing 600 KB per row back into the object store is the same saving for
    # both predictors.
    return {k: v for k, v in batch.items() if k not in ("INPUT0", "INPUT1")}


class OurPredictor:
    """``TritonPredictor`` returning ids and outputs only (see :func:`_without_inputs`)."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = TritonPredictor(**kwargs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _without_inputs(self._inner(batch))


class GrpcPredictor:
    """What users write without this package: ``tritonclient.grpc`` in ``map_batches``.

    Batches are split into the model's ``max_batch_size`` and the pieces sent
    from ``parallel`` threads (as our predictor does across its slots).
    """

    def __init__(self, model: str, grpc_url: str, max_batch: int = 8, parallel: int = 2) -> None:
        self.model = model
        self.max_batch = max_batch
        self._clients = [grpcclient.InferenceServerClient(grpc_url) for _ in range(parallel)]
        self._pool = ThreadPoolExecutor(parallel)

    def _run(self, index: int, batch: dict[str, np.ndarray], start: int) -> dict[str, np.ndarray]:
        stop = start + self.max_batch
        tensors = []
        for name, dtype in (("INPUT0", "FP32"), ("INPUT1", "INT32")):
            part = np.ascontiguousarray(batch[name][start:stop])
            tensor = grpcclient.InferInput(name, list(part.shape), dtype)
            tensor.set_data_from_numpy(part)
            tensors.append(tensor)
        response = self._clients[index % len(self._clients)].infer(self.model, tensors)
        return {name: response.as_numpy(name) for name in ("OUTPUT0", "OUTPUT1")}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        starts = range(0, len(batch["INPUT0"]), self.max_batch)
        parts = list(self._pool.map(lambda a: self._run(a[0], batch, a[1]), enumerate(starts)))
        out = _without_inputs(batch)
        for name in ("OUTPUT0", "OUTPUT1"):
            out[name] = np.concatenate([p[name] for p in parts])
        return out


class LocalPredictor:
    """The reference without Triton: ``multi_io``'s sums computed by numpy in the map worker.

    What Ray Data's own per-batch handling allows on this machine, as
    ``serve-echo`` is for Serve.
    """

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, ints = batch["INPUT0"], batch["INPUT1"]
        rows = len(images)
        out = _without_inputs(batch)
        out["OUTPUT0"] = images.reshape(rows, 512, 294).sum(axis=-1, dtype=np.float32)
        out["OUTPUT1"] = ints.reshape(rows, 5, 2).sum(axis=-1, dtype=np.int32)
        return out


def make_source(rows: int, batch_size: int) -> Any:
    """The image rows both Data methods read, materialised once in the object store."""
    blocks = max(1, rows // batch_size)
    source = ray.data.range(rows, override_num_blocks=blocks).map_batches(make_rows, batch_size=batch_size)
    return source.materialize()


@dataclass(frozen=True)
class DataTiming:
    """One streamed run of ``map_batches``.

    Attributes:
        rows_timed: Rows that arrived after the first batch.
        span_s: Time from the first batch to the last.
        gaps_s: Times between consecutive batches.
        rows_seen: Rows that came out, the first batch included.
    """

    rows_timed: int
    span_s: float
    gaps_s: tuple[float, ...]
    rows_seen: int

    @property
    def rows_per_s(self) -> float:
        return self.rows_timed / self.span_s


def run_data(
    method: str,
    source: Any,
    rows: int,
    batch_size: int,
    actors: int,
    node_config: Any,
    grpc_url: str,
    model: str = DATA_MODEL,
) -> DataTiming:
    """Stream ``rows`` image rows through ``map_batches`` and time the steady state.

    ``model`` is a ``multi_io`` (the Python backend's or the native one).
    The clock starts when the first output batch arrives (actor start-up is
    excluded, the same for both sides).

    Raises:
        OutputMismatch: Outputs differ from numpy's, or rows went missing.
    """
    if method == "data-ours":
        fn: Callable[..., Any] | type = OurPredictor
        kwargs: dict[str, Any] = {"model": model, "node_config": node_config}
    elif method == "data-local":
        fn, kwargs = LocalPredictor, {}
    else:
        fn, kwargs = GrpcPredictor, {"model": model, "grpc_url": grpc_url}
    mapped = source.map_batches(
        fn,
        fn_constructor_kwargs=kwargs,
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=0.5,
    )
    first_t = last_t = 0.0
    first_rows = seen = 0
    gaps: list[float] = []
    began = time.perf_counter()
    for batch in mapped.iter_batches(batch_size=None, batch_format="numpy"):
        now = time.perf_counter()
        n = len(batch["id"])
        check_data_batch(method, batch)
        if not seen:
            first_t, first_rows = now, n
        else:
            gaps.append(now - last_t)
        last_t = now
        seen += n
    if seen != rows:
        raise OutputMismatch(f"{method}: {seen} rows came out of {rows}")
    if seen == first_rows:  # a single batch: no steady state to time, count from the start
        span = max(last_t - began, 1e-9)
        return DataTiming(seen, span, (span,), seen)
    return DataTiming(seen - first_rows, max(last_t - first_t, 1e-9), tuple(gaps), seen)
