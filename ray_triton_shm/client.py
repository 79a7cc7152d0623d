"""Zero-copy inference against a local Triton through shared-memory slots.

Example:
    >>> import numpy as np
    >>> from ray_triton_shm import PoolConfig, TritonShmClient
    >>> with TritonShmClient(url=server.grpc_url) as client:            # doctest: +SKIP
    ...     out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})   # copies outputs out
    ...     out.path                                                    # "shm" or "grpc"
    ...     with client.infer_views("identity", {"INPUT0": x}) as views:  # zero-copy outputs
    ...         total = views["OUTPUT0"].sum()
    ...     with client.lease("multi_io") as lease:                     # fill inputs in place
    ...         lease.input("INPUT0", (8, 3, 224, 224))[:] = 0.5
    ...         lease.input("INPUT1", (8, 10))[:] = 1
    ...         views = client.run(lease)

Each model gets a pool of slots in one shared-memory segment, registered
with Triton once. ``infer`` validates inputs, leases a slot, writes the
inputs, asks Triton to read and write in place, and copies the outputs out.
Batches larger than a slot are split and run concurrently across slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ray_triton_shm._private.core.local_pools import LocalPools
from ray_triton_shm._private.core.model_pools import ModelPools, PoolSource
from ray_triton_shm._private.core.slot_runs import SlotRunner, to_device
from ray_triton_shm._private.shm.bulk_copy import BulkCopier, default_copy_threads
from ray_triton_shm._private.shm.layout import ModelLayout, ModelSignature
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import PoolStats, SlotPool
from ray_triton_shm._private.shm.validate import (
    CheckedInputs,
    bytes_overflow,
    check_inputs,
    check_signature_inputs,
)
from ray_triton_shm._private.triton.grpc_channel import TritonGrpc
from ray_triton_shm._private.triton.http_infer import HttpShmSender
from ray_triton_shm._private.triton.observe import NULL_OBSERVER, Observer, safely
from ray_triton_shm._private.triton.triton_requests import TritonRequests
from ray_triton_shm.config import ClientConfig
from ray_triton_shm.errors import (
    InputError,
    LayoutMismatchError,
    LeaseReleasedError,
    OutputTooLargeError,
    PoolClosedError,
    RayTritonShmError,
)

__all__ = ["InferResult", "PoolSource", "TritonShmClient"]

logger = logging.getLogger(__name__)


class InferResult(dict):
    """Outputs by name, plus ``path``: ``"shm"``, ``"cuda_shm"`` or ``"grpc"``, the way they travelled.

    Outputs of a CUDA pool (``path == "cuda_shm"``) are cupy arrays on its GPU.
    """

    path: str

    def __init__(self, outputs: Mapping[str, np.ndarray], path: str) -> None:
        super().__init__(outputs)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (InferResult, (dict(self), self.path))


# Threads for ainfer's calls: a call waiting for a slot holds one while it waits.
_ASYNC_THREADS = 64


class TritonShmClient:
    """Inference through shared memory against one Triton server on this machine.

    Args:
        config: Client configuration; keyword arguments override its fields.
        pool_source: Supplies slot pools; by default pools are created here
            and registered with the server.
        observer: Told about every request, lease wait and error (metrics);
            by default nothing is recorded.
        **overrides: Fields of :class:`ClientConfig` (``url``, ``pools``, ...).

    Raises:
        ConfigError: Invalid configuration.
    """

    def __init__(
        self,
        config: ClientConfig | None = None,
        *,
        pool_source: PoolSource | None = None,
        observer: Observer | None = None,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = ClientConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        # A channel that is still backing off from a server that is back is replaced, not failed on.
        self._grpc = TritonGrpc(config.url)
        # Shared-memory requests carry only descriptors; HTTP sends them for less CPU than gRPC.
        self._http = HttpShmSender(config.http_url, config.request_timeout_s) if config.http_url else None
        self._source: PoolSource = pool_source or LocalPools(
            self._grpc, config.server_visible_devices, config.shm_api_key, url=config.url
        )
        self._observer: Observer = observer or NULL_OBSERVER
        self._requests = TritonRequests(
            self._grpc,
            self._http,
            config.request_timeout_s,
            self._observer,
            getattr(self._source, "reregister", None),
            self.verify_layout,
        )
        self._lock = threading.Lock()
        self._models = ModelPools(self._source, self._grpc, config, self._lock, lambda: self._closed)
        self._pools = self._models.pools  # by model; the same dict
        self._fallbacks: set[str] = set()  # models whose requests grpc_fallback sent over gRPC (logged once)
        self._async_executor: ThreadPoolExecutor | None = None
        self._copier = BulkCopier(config.copy_threads or default_copy_threads())
        self._runner = SlotRunner(
            self._requests, self._observer, self._copier, config.max_parallel_chunks, lambda: self._closed
        )
        self._closed = False

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> TritonShmClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Unregister and free every pool, then close the connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor, self._async_executor = self._async_executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._runner.close()
        self._copier.close()
        self._source.close()
        self._pools.clear()
        if self._http is not None:
            self._http.close()
        self._grpc.close()

    # -- pools -------------------------------------------------------------
    def layout(self, model: str) -> ModelLayout:
        """The slot layout of ``model`` (that of its pool, created on first use).

        Raises:
            TritonCallError: The server does not know the model.
            LayoutError: The model cannot use shared-memory slots.
        """
        return self.pool(model).layout

    def pool(self, model: str) -> SlotPool:
        """The slot pool of ``model``, created and registered on first use.

        Raises:
            PoolClosedError: The client is closed.
            TritonCallError / LayoutError / SharedMemoryError: As creation fails.
        """
        return self._models.pool(model)

    def signature(self, model: str) -> ModelSignature:
        """Every input and output of ``model`` as its configuration declares them (no layout needed).

        Raises:
            TritonCallError: The server does not know the model.
        """
        return self._models.signature(model)

    def shm_unavailable_reason(self, model: str) -> str | None:
        """Why ``model`` goes over plain gRPC rather than slots, or ``None`` if it has slots.

        Raises:
            TritonCallError: The server does not know the model.
        """
        return None if self._layout_or_none(model) is not None else self._models.no_layout[model]

    def verify_layout(self, layout: ModelLayout) -> None:
        """Check that the server still runs the model configuration ``layout`` was derived from.

        Raises:
            LayoutMismatchError: The model was reloaded with another configuration.
            TritonCallError: The server does not know the model (any more).
        """
        self._models.verify_layout(layout)

    def _layout_or_none(self, model: str) -> ModelLayout | None:
        """The model's slot layout, or ``None`` when it has none (the reason is logged once)."""
        return self._models.layout_or_none(model)

    def pool_stats(self) -> list[PoolStats]:
        """Slot usage of every pool this client uses."""
        return [pool.stats() for pool in list(self._pools.values())]

    # -- leases ------------------------------------------------------------
    def lease(self, model: str, timeout: float | None = None) -> Lease:
        """Lease a slot of ``model`` to fill in place; use it in a ``with`` block.

        Args:
            model: Model name.
            timeout: Seconds to wait for a free slot; default from the pool config.

        Raises:
            PoolTimeoutError: No slot became free in time.
        """
        pool = self.pool(model)
        return self._runner.acquire(pool, self._lease_timeout(model, timeout))

    async def alease(self, model: str, timeout: float | None = None) -> Lease:
        """:meth:`lease` for asyncio code."""
        pool = self._pools.get(model)
        if pool is None or pool.retired:
            pool = await asyncio.to_thread(self.pool, model)
        started = time.perf_counter()
        lease = await pool.acquire_async(self._lease_timeout(model, timeout))
        safely(self._observer.lease_wait, model, time.perf_counter() - started)
        return lease

    def _lease_timeout(self, model: str, timeout: float | None) -> float:
        return self.config.pool_for(model).lease_timeout_s if timeout is None else timeout

    def run(self, lease: Lease, outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the model on the inputs already in ``lease``'s slot.

        Inputs must have been placed with ``lease.input(name, shape)`` (or
        written by :meth:`infer`). Returns read-only views into the slot that
        stay valid until the lease ends; the slot is not reused while any of
        them is alive.

        Raises:
            InputError: Not every input was placed, or a recorded shape outgrows the slot.
            SharedMemoryError: A tensor's span would run past the segment (refused locally).
            LeaseReleasedError: The lease has ended.
            OutputTooLargeError: An output does not fit its slot.
            TritonCallError: The server refused the request.
        """
        if lease.released:
            raise LeaseReleasedError("this lease was released; its slot may belong to someone else")
        layout = lease.layout
        missing = [spec.name for spec in layout.inputs if spec.name not in lease.input_shapes]
        if missing:
            raise InputError(f"lease of {layout.model!r} has no shape for inputs {missing}")
        shapes = self._call_shm(lease, lease.input_shapes, outputs)
        return {name: lease.output(name, shape) for name, shape in shapes.items()}

    @property
    def posts_shm_over_http(self) -> bool:
        """Whether shm requests go to Triton's HTTP endpoint (then :meth:`begin_run` gives their bytes)."""
        return self._requests.over_http

    def begin_run(
        self, lease: Lease, outputs: Sequence[str] | None = None
    ) -> tuple[Any, str, bytes, float | None] | None:
        """:meth:`run` in two halves, for a caller that posts the request itself: the request begun on
        the lease, Triton's HTTP address, the bytes to post and the answer's timeout. ``None``: this
        client sends shm requests over gRPC (use :meth:`run`). End it with :meth:`finish_run`.

        Raises:
            As :meth:`run`, for what is refused before anything is sent.
        """
        if not self._requests.over_http:
            return None
        if lease.released:
            raise LeaseReleasedError("this lease was released; its slot may belong to someone else")
        layout = lease.layout
        missing = [spec.name for spec in layout.inputs if spec.name not in lease.input_shapes]
        if missing:
            raise InputError(f"lease of {layout.model!r} has no shape for inputs {missing}")
        request = self._requests.begin_shm(lease, lease.input_shapes, outputs)
        address, data, timeout_s = self._requests.wire_request(request)  # type: ignore[misc]
        return request, address, data, timeout_s

    def finish_run(self, request: Any, code: int, body: bytes, retry: bool) -> dict[str, np.ndarray] | None:
        """:meth:`run`'s outputs from Triton's answer to :meth:`begin_run`'s bytes (``code``: the HTTP
        status, ``-1`` no answer in time, ``-2`` unreachable); ``None``: post the bytes once more
        (the pool was registered again; only if ``retry``).

        Raises:
            As :meth:`run`.
        """
        shapes = self._requests.finish_shm(request, code, body, retry)
        if shapes is None:
            return None
        lease = request.lease
        return {name: lease.output(name, shape) for name, shape in shapes.items()}

    # -- inference ---------------------------------------------------------
    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        copy: bool = True,
    ) -> InferResult:
        """Run ``model`` on ``inputs`` and return copies of its outputs.

        Args:
            model: Model name.
            inputs: Arrays by input name (exact dtypes; any memory layout).
            outputs: Output names to return; all by default.
            timeout: Seconds to wait for a free slot; default from the pool config.
            copy: ``False`` returns read-only views into the slot when the batch
                fits one slot: the slot is not reused while any of them is alive.
                For outputs that go straight to a serializer (a Ray Serve
                replica's return value), which copies them anyway. BYTES
                outputs are always copied out (parsed into ``object`` arrays).

        BYTES (STRING) inputs take numpy arrays of ``bytes``/``str`` (``object``,
        ``S`` or ``U`` dtypes) and are serialised into the slot (Triton's form,
        4-byte length prefixes); BYTES outputs come back as ``object`` arrays of
        ``bytes``. A request with an input element longer than
        ``PoolConfig.max_element_bytes`` goes over plain gRPC (``path ==
        "grpc"``, the reason logged once per model): nothing was sent yet, so
        this costs nothing. A BYTES output larger than its region is an
        output that does not fit (below).

        Returns:
            Outputs by name; ``.path`` says whether shm or plain gRPC was used.

        Raises:
            InputError: Inputs do not match the model; nothing was sent.
            PoolTimeoutError: No slot became free in time.
            OutputTooLargeError: An output does not fit its slot and ``grpc_fallback`` is off.
            TritonCallError / UnavailableError: The server refused or is gone.
            PoolClosedError: The client is closed, or was closed by another thread during the call.
        """
        layout = self._layout_or_none(model)
        if layout is None:
            return self.infer_grpc(model, inputs, outputs=outputs)
        pool = self.pool(model)
        checked = self._check(layout, inputs)
        wanted = self._wanted_outputs(layout, outputs)
        # GPU data (a CUDA pool, or device inputs) never goes over host gRPC because it is small.
        on_gpu = pool.memory == "cuda" or checked.on_device
        threshold = self.config.pool_for(model).shm_threshold(over_http=self._http is not None, cuda=on_gpu)
        if checked.nbytes < threshold:
            return InferResult(self._call_grpc(model, checked, wanted), "grpc")
        overflow = bytes_overflow(layout, checked)
        if overflow is not None:  # a string longer than a slot's per-element bound: nothing sent yet
            self._note_fallback(model, overflow)
            return InferResult(self._call_grpc(model, checked, wanted), "grpc")
        try:
            return self._infer_shm(model, checked, wanted, self._lease_timeout(model, timeout), copy)
        except OutputTooLargeError as e:
            if not self.config.grpc_fallback:
                raise
            self._note_fallback(model, str(e))
            result = self._call_grpc(model, checked, wanted)
            if pool.memory == "cuda":  # outputs of a CUDA pool are cupy arrays, whichever way they came
                result = to_device(result, pool)
            return InferResult(result, "grpc")

    def _note_fallback(self, model: str, reason: str) -> None:
        """Log why a request of ``model`` goes over plain gRPC: a warning the first time per model."""
        with self._lock:
            first = model not in self._fallbacks
            self._fallbacks.add(model)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "model %r: request sent over plain gRPC: %s", model, reason)

    def _infer_shm(
        self, model: str, checked: CheckedInputs, wanted: list[str], lease_timeout: float, copy: bool = True
    ) -> InferResult:
        pool = self.pool(model)
        path = "cuda_shm" if pool.memory == "cuda" else "shm"
        return InferResult(self._runner.run(pool, checked, wanted, lease_timeout, copy), path)

    async def ainfer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        copy: bool = True,
    ) -> InferResult:
        """:meth:`infer` for asyncio code; the event loop is not blocked.

        Raises:
            The same errors as :meth:`infer`.
        """
        loop = asyncio.get_running_loop()
        call = functools.partial(self.infer, model, inputs, outputs=outputs, timeout=timeout, copy=copy)
        return await loop.run_in_executor(self._threads_for_async(), call)

    def _threads_for_async(self) -> ThreadPoolExecutor:
        # Not the event loop's default executor: a call waiting there for a slot would hold one of
        # its few threads, and code that lets a slot go (the end of an HTTP answer that reads the
        # outputs in place) may need one of them: every slot then waits out its lease timeout.
        with self._lock:
            if self._closed:
                raise PoolClosedError("the client is closed")
            if self._async_executor is None:
                self._async_executor = ThreadPoolExecutor(_ASYNC_THREADS, thread_name_prefix="rtshm-ainfer")
            return self._async_executor

    @contextlib.contextmanager
    def infer_views(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Run ``model`` and yield zero-copy, read-only views of its outputs.

        The views are valid inside the ``with`` block; the slot is not reused
        while any of them is alive. The batch must fit one slot. BYTES outputs
        are parsed out of the slot instead (``object`` arrays, copies).

        Raises:
            InputError: Inputs do not match, the batch is larger than a slot, or
                a BYTES element is longer than a slot holds.
            PoolTimeoutError / TritonCallError: As for :meth:`infer`.
        """
        layout = self.layout(model)
        checked = self._check(layout, inputs)
        if checked.batch > layout.batch_capacity:
            raise InputError(
                f"batch {checked.batch} exceeds a slot's capacity {layout.batch_capacity}; "
                "use infer() to split it"
            )
        wanted = self._wanted_outputs(layout, outputs)
        overflow = bytes_overflow(layout, checked)
        if overflow is not None:
            raise InputError(f"{overflow}; infer() sends such requests over plain gRPC")
        with self.lease(model, timeout) as lease:
            shapes = self._runner.write_and_call(lease, checked, (0, checked.batch), wanted)
            yield {name: lease.output(name, shape) for name, shape in shapes.items()}

    def infer_grpc(
        self, model: str, inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None
    ) -> InferResult:
        """Run ``model`` over plain gRPC (tensors serialised): any model Triton serves, no slots needed.

        BYTES tensors take numpy arrays of ``bytes``/``str`` (``object``, ``S`` or
        ``U`` dtypes) and come back as ``object`` arrays of ``bytes``.

        Raises:
            InputError / TritonCallError: As for :meth:`infer`.
        """
        signature = self.signature(model)
        try:
            checked = check_signature_inputs(signature, inputs)
        except RayTritonShmError as e:
            safely(self._observer.error, model, type(e).__name__)
            raise
        names = [spec.name for spec in signature.outputs]
        unknown = [name for name in outputs or () if name not in names]
        if unknown:
            raise InputError(f"model {model!r} has outputs {names}; unknown: {unknown}")
        return InferResult(self._call_grpc(model, checked, list(outputs) if outputs else names), "grpc")

    # -- internals ---------------------------------------------------------
    @staticmethod
    def _wanted_outputs(layout: ModelLayout, outputs: Sequence[str] | None) -> list[str]:
        names = [spec.name for spec in layout.outputs]
        if outputs is None:
            return names
        unknown = [name for name in outputs if name not in names]
        if unknown:
            raise InputError(f"model {layout.model!r} has outputs {names}; unknown: {unknown}")
        return list(outputs)

    def _check(self, layout: ModelLayout, inputs: Mapping[str, Any]) -> CheckedInputs:
        try:
            return check_inputs(layout, inputs)
        except RayTritonShmError as e:
            safely(self._observer.error, layout.model, type(e).__name__)
            if isinstance(e, InputError) and layout.fingerprint:
                self._mismatch_or_none(layout)  # inputs fitting a reloaded model's new config: say so
            raise

    def _mismatch_or_none(self, layout: ModelLayout) -> None:
        """Raise :class:`LayoutMismatchError` if the server runs another config than ``layout``'s."""
        try:
            self.verify_layout(layout)
        except LayoutMismatchError:
            raise
        except RayTritonShmError as e:  # cannot tell: the caller's own error stands
            logger.debug("verifying the layout of %r failed: %s", layout.model, e)

    def _call_shm(
        self,
        lease: Lease,
        shapes: Mapping[str, tuple[int, ...]],
        wanted: Sequence[str] | None,
    ) -> dict[str, tuple[int, ...]]:
        """Run the model on the inputs in ``lease``'s slot (slot references come this way too)."""
        return self._requests.call_shm(lease, shapes, wanted)

    def _call_grpc(self, model: str, checked: CheckedInputs, wanted: list[str]) -> dict[str, np.ndarray]:
        """Run ``model`` with its tensors serialised into the request; returns the outputs."""
        return self._requests.call_grpc(model, checked, wanted)
