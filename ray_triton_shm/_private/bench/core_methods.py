"""The client-side methods, each against the same Triton and one identity model.

``Endpoints.model`` names it: ``identity`` on the Python backend, or
``identity_native`` on the native C backend that reads and writes our regions
in place (see :mod:`ray_triton_shm._private.bench.servers`).

A method opens a *cell* for one payload size and caller count: per-caller
callables (``call(check)``) plus a ``close``. Every caller sends its own
input (so a mix-up between callers is caught) and checks, when asked, that
the output equals it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from ray_triton_shm.client import TritonShmClient
from ray_triton_shm.config import PoolConfig

MODEL = "identity"
"""The Python backend's identity, the default of :class:`Endpoints`."""

Caller = Callable[[bool], object]


class OutputMismatch(AssertionError):
    """A method returned outputs that differ from what the model must produce."""


@dataclass
class Cell:
    """Callers of one (method, payload, concurrency) cell and what to close afterwards."""

    callers: list[Caller]
    closers: list[Callable[[], None]] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)
    extra: dict[str, float] = field(default_factory=dict)
    """Figures the cell measured besides its calls (kept in the record's ``extra``)."""

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()


@dataclass(frozen=True)
class Endpoints:
    """Where the one Triton of the run listens."""

    grpc_url: str
    http_url: str
    model: str = MODEL


def make_inputs(payload_bytes: int, concurrency: int, seed: int = 0) -> list[np.ndarray]:
    """One distinct ``(1, n)`` float32 input per caller."""
    n = max(1, payload_bytes // 4)
    base = np.random.default_rng(seed).random((1, n), dtype=np.float32)
    inputs = []
    for index in range(concurrency):
        x = base.copy()
        x[0, 0] = float(index)  # distinct per caller, cheap to make
        inputs.append(x)
    return inputs


def check_equal(method: str, got: np.ndarray, want: np.ndarray) -> None:
    """Raise :class:`OutputMismatch` unless ``got`` equals ``want`` exactly."""
    if got.shape != want.shape or not np.array_equal(got, want):
        raise OutputMismatch(f"{method}: output differs from the identity of its input")


# -- memcpy reference ------------------------------------------------------
def memcpy_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """The physical reference: copy the payload into a preallocated buffer."""

    def caller(x: np.ndarray) -> Caller:
        dst = np.empty_like(x)

        def call(check: bool) -> object:
            np.copyto(dst, x)
            if check:
                check_equal("memcpy", dst, x)
            return dst

        return call

    return Cell([caller(x) for x in inputs])


# -- tritonclient ------------------------------------------------------------
def grpc_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """Plain ``tritonclient.grpc``: one client per caller (its clients are not thread-safe)."""
    cell = Cell([])

    def caller(x: np.ndarray) -> Caller:
        client = grpcclient.InferenceServerClient(endpoints.grpc_url)
        cell.closers.append(client.close)
        requested = [grpcclient.InferRequestedOutput("OUTPUT0")]

        def call(check: bool) -> object:
            tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            out = client.infer(endpoints.model, [tensor], outputs=requested).as_numpy("OUTPUT0")
            if check:
                check_equal("grpc", out, x)
            return out

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


def http_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """``tritonclient.http`` with binary tensors, one client per caller."""
    cell = Cell([])

    def caller(x: np.ndarray) -> Caller:
        client = httpclient.InferenceServerClient(endpoints.http_url, network_timeout=600.0)
        cell.closers.append(client.close)
        requested = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]

        def call(check: bool) -> object:
            tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            out = client.infer(endpoints.model, [tensor], outputs=requested).as_numpy("OUTPUT0")
            if check:
                check_equal("http", out, x)
            return out

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


# -- triton-shm-client 0.1.0 -------------------------------------------------
def competitor_path() -> str:
    """Where ``make bench`` installs triton-shm-client (never a dependency of this package)."""
    return os.environ.get(
        "RAY_TRITON_SHM_BENCH_EXTRA", os.path.abspath(os.path.join(".cache", "bench-extra"))
    )


def import_competitor() -> object | None:
    """The ``triton_shm_client`` module, or None if it is not installed."""
    try:
        return importlib.import_module("triton_shm_client")
    except ImportError:
        extra = competitor_path()
        if os.path.isdir(extra) and extra not in sys.path:
            sys.path.append(extra)
            try:
                return importlib.import_module("triton_shm_client")
            except ImportError:
                return None
        return None


def competitor_version() -> str | None:
    module = import_competitor()
    return getattr(module, "__version__", None) if module is not None else None


def tsc_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """``triton-shm-client``: one client shared by all callers, one slot per caller (its design)."""
    module = import_competitor()
    if module is None:
        raise RuntimeError("triton-shm-client is not installed (make bench installs it)")
    n = inputs[0].shape[1]
    client = module.TritonSHMClient(url=endpoints.grpc_url)
    cell = Cell([], [client.close])
    try:
        client.register_shm_model(
            endpoints.model,
            inputs=[("INPUT0", (n,), np.float32)],
            outputs=[("OUTPUT0", (n,), np.float32)],
            max_batch_size=1,
            pool_size=len(inputs),
        )
    except BaseException:
        cell.close()
        raise

    def caller(x: np.ndarray) -> Caller:
        def call(check: bool) -> object:
            out = client.infer_shm(endpoints.model, {"INPUT0": x})["OUTPUT0"]
            if check:
                check_equal("triton-shm-client", out, x)
            return out

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


# -- ours ----------------------------------------------------------------------
def _our_client(endpoints: Endpoints, n: int, slots: int, *, over_http: bool = True):
    pool = PoolConfig(slots=slots, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    http_url = endpoints.http_url if over_http else None
    return TritonShmClient(url=endpoints.grpc_url, http_url=http_url, pools={endpoints.model: pool})


def ours_copy_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """Our ``infer``: outputs copied out; the path (shm or gRPC) chosen by the default config."""
    client = _our_client(endpoints, inputs[0].shape[1], len(inputs))
    cell = Cell([], [client.close])

    def caller(x: np.ndarray) -> Caller:
        def call(check: bool) -> object:
            result = client.infer(endpoints.model, {"INPUT0": x})
            if check:
                cell.paths.add(result.path)
                check_equal("ours copy", result["OUTPUT0"], x)
            return result

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


def ours_views_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """Our ``infer_views``: inputs copied into the slot, outputs read in place (zero-copy)."""
    client = _our_client(endpoints, inputs[0].shape[1], len(inputs))
    cell = Cell([], [client.close], {"shm"})

    def caller(x: np.ndarray) -> Caller:
        def call(check: bool) -> object:
            with client.infer_views(endpoints.model, {"INPUT0": x}) as views:
                out = views["OUTPUT0"]
                if check:
                    check_equal("ours views", out, x)
                return out.shape

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


def ours_inplace_cell(endpoints: Endpoints, inputs: list[np.ndarray], *, over_http: bool = True) -> Cell:
    """Our lease API: each caller owns a slot whose input a producer wrote in place once.

    A timed call is ``client.run(lease)`` and reading the output views: no input
    copy (the producer made its data in the slot), no output copy. Shm requests
    go over Triton's HTTP endpoint, as they do by default from a node actor.
    """
    client = _our_client(endpoints, inputs[0].shape[1], len(inputs), over_http=over_http)
    cell = Cell([], [client.close], {"shm"})

    def caller(x: np.ndarray) -> Caller:
        lease = client.lease(endpoints.model)
        cell.closers.append(lease.release)
        lease.input("INPUT0", x.shape)[...] = x

        def call(check: bool) -> object:
            out = client.run(lease)["OUTPUT0"]
            if check:
                check_equal("ours in-place", out, x)
            return out.shape

        return call

    cell.callers = [caller(x) for x in inputs]
    return cell


def ours_inplace_grpc_cell(endpoints: Endpoints, inputs: list[np.ndarray]) -> Cell:
    """``ours-inplace`` with its shm requests sent through ``tritonclient.grpc`` (no ``http_url``)."""
    return ours_inplace_cell(endpoints, inputs, over_http=False)


CORE_METHODS: dict[str, Callable[[Endpoints, list[np.ndarray]], Cell]] = {
    "memcpy": memcpy_cell,
    "grpc": grpc_cell,
    "http": http_cell,
    "triton-shm-client": tsc_cell,
    "ours-copy": ours_copy_cell,
    "ours-views": ours_views_cell,
    "ours-inplace": ours_inplace_cell,
    "ours-inplace-grpc": ours_inplace_grpc_cell,
}
"""Method name -> cell factory, in report order."""
