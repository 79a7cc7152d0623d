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
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.bulk_copy import BulkCopier, default_copy_threads
from ray_triton_shm._private.bytes_tensor import serialized_size
from ray_triton_shm._private.call_errors import IN_DOUBT_STATUSES, call_error, region_unknown
from ray_triton_shm._private.grpc_channel import GrpcClient, TritonGrpc
from ray_triton_shm._private.http_infer import HttpShmSender, ShmInput, ShmOutput, check_datatype
from ray_triton_shm._private.layout import (
    NUMPY_TO_TRITON,
    ModelLayout,
    ModelSignature,
    config_fingerprint,
    layout_from_config,
    signature_from_config,
)
from ray_triton_shm._private.observe import NULL_OBSERVER, Observer, safely
from ray_triton_shm._private.pool import Lease, PoolStats, SlotPool
from ray_triton_shm._private.segment import check_span, redact
from ray_triton_shm._private.validate import (
    CheckedInputs,
    bytes_nbytes,
    bytes_overflow,
    check_inputs,
    check_signature_inputs,
)
from ray_triton_shm.config import ClientConfig, PoolConfig
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    LayoutMismatchError,
    LeaseReleasedError,
    OutputTooLargeError,
    PoolClosedError,
    RayTritonShmError,
    TritonCallError,
)

__all__ = ["InferResult", "PoolSource", "TritonShmClient"]

logger = logging.getLogger(__name__)

_UNREGISTER_WAIT_S = 5.0


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


def _status_name(error: InferenceServerException) -> str | None:
    status = error.status()
    return str(status).rsplit(".", 1)[-1] if status else None


def translate_error(error: InferenceServerException, model: str | None = None) -> TritonCallError:
    """Turn a tritonclient exception into ours (typed by gRPC status), segment keys redacted."""
    return call_error(str(error.message() or error), _status_name(error), model)


def fetch_layout(grpc: GrpcClient, model: str, config: PoolConfig) -> ModelLayout:
    """Derive ``model``'s slot layout from its configuration on the server.

    Raises:
        TritonCallError: The server does not know the model.
        LayoutError: The model cannot use shared-memory slots.
    """
    try:
        model_config = grpc.get_model_config(model, as_json=True)["config"]
    except InferenceServerException as e:
        raise translate_error(e, model) from e
    return layout_from_config(model_config, config)


class PoolSource(Protocol):
    """Where a client gets its slot pools (created here, or granted by a Ray node actor).

    A pool carries the layout it was built with; the client validates against it.
    """

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool: ...

    def close(self) -> None: ...


class LocalPools:
    """Pools created and registered with Triton by this process."""

    def __init__(
        self,
        grpc: GrpcClient,
        server_visible_devices: str | None = None,
        shm_api_key: str | None = None,
        url: str = "",
    ) -> None:
        from ray_triton_shm.server import SHM_API_GRPC_HEADER

        self._grpc = grpc
        self._url = url
        self._server_visible = server_visible_devices
        self._headers = {SHM_API_GRPC_HEADER: shm_api_key} if shm_api_key else None
        self._pools: list[SlotPool] = []
        self._lock = threading.Lock()
        self._closed = False

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        layout = fetch_layout(self._grpc, model, config)
        if config.memory == "cuda":
            from ray_triton_shm._private.cuda_pool import CudaSlotPool

            pool: SlotPool = CudaSlotPool.create(layout, config.slots, device=config.device_id)
        else:
            pool = SlotPool.create(layout, config.slots)
        try:
            self._register(pool)
        except BaseException:
            pool.close()
            raise
        self._pools.append(pool)
        logger.info(
            "registered pool %s for %s: %d slots x %d bytes",
            pool.region_name,
            model,
            config.slots,
            layout.slot_bytes,
        )
        return pool

    def _register(self, pool: SlotPool) -> None:
        model = pool.layout.model
        if pool.memory != "cuda":
            check_span(pool.region_name, pool.segment.size, 0, pool.segment.size)
            try:
                self._grpc.register_system_shared_memory(
                    pool.region_name, pool.segment.key, pool.segment.size, headers=self._headers
                )
            except InferenceServerException as e:
                raise translate_error(e, model) from e
            return
        from ray_triton_shm._private.cuda_devices import server_device_id, server_visible_devices_of
        from ray_triton_shm.errors import CudaError

        buffer = pool.buffer  # type: ignore[attr-defined]
        device = server_device_id(
            buffer.device,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            server_visible_devices_of(self._server_visible, self._url),
        )
        check_span(pool.region_name, buffer.size, 0, buffer.size)
        try:
            self._grpc.register_cuda_shared_memory(
                pool.region_name, buffer.handle_b64, device, buffer.size, headers=self._headers
            )
        except InferenceServerException as e:
            if _status_name(e) == "ALREADY_EXISTS":
                raise translate_error(e, model) from e
            raise CudaError(
                f"Triton refused CUDA region {pool.region_name!r} of {model!r} on its GPU {device}: "
                f"{redact(str(e.message() or e))}"
            ) from e

    def reregister(self, pool: SlotPool) -> None:
        """Register ``pool`` again after the server lost it (e.g. it restarted).

        Raises:
            PoolClosedError: The pools were closed meanwhile.
            TritonCallError: The server refused.
            CudaError: The server refused a CUDA region.
        """
        with self._lock:
            if self._closed:  # a request that raced close(): never register a freed segment again
                raise PoolClosedError("the client is closed")
            try:
                self._register(pool)
            except TritonCallError as e:
                if e.status == "ALREADY_EXISTS":  # another thread got there first
                    return
                raise
        logger.warning("re-registered pool of %s: the server had lost it", pool.layout.model)

    def _unregister(self, pool: SlotPool) -> None:
        # Triton refuses while a request still uses the region; such requests end soon.
        deadline = time.monotonic() + _UNREGISTER_WAIT_S
        while True:
            try:
                if pool.memory == "cuda":
                    self._grpc.unregister_cuda_shared_memory(pool.region_name, headers=self._headers)
                else:
                    self._grpc.unregister_system_shared_memory(pool.region_name, headers=self._headers)
                return
            except InferenceServerException as e:
                if "in use" in str(e.message()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                # The server may be gone already; whether a CUDA region may be freed is
                # decided by _cuda_region_gone.
                logger.debug("unregister %s failed: %s", pool.region_name, e)
                return

    def _cuda_region_gone(self, pool: SlotPool) -> bool:
        """Whether Triton has let go of ``pool``'s CUDA region, polling its status until NOT_FOUND.

        Since Triton r24.11 unregistering a region that a request still uses
        succeeds and the region is closed when the request ends, so success
        alone does not mean the memory is free to go. A server that cannot be
        reached (UNAVAILABLE: not listening) holds nothing.
        """
        deadline = time.monotonic() + _UNREGISTER_WAIT_S
        while True:
            try:
                status = self._grpc.get_cuda_shared_memory_status(
                    pool.region_name, headers=self._headers, as_json=True
                )
            except InferenceServerException as e:
                message = str(e.message() or e).lower()
                if _status_name(e) in ("NOT_FOUND", "UNAVAILABLE") or "unable to find" in message:
                    return True
                logger.debug("status of %s: %s", pool.region_name, e)
            else:
                if pool.region_name not in ((status or {}).get("regions") or {}):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for pool in self._pools:
            wait = pool.in_doubt_until() - time.monotonic()
            if pool.memory == "cuda" and wait > 0:
                # A timed-out request may still run on the server: its device memory must outlive it.
                logger.warning(
                    "waiting %.1fs before freeing %s: a request may be in flight", wait, pool.region_name
                )
                time.sleep(wait)
            self._unregister(pool)
            if pool.memory == "cuda" and not self._cuda_region_gone(pool):
                # Freeing memory Triton may still write to could corrupt whatever reuses it.
                logger.warning(
                    "Triton still holds CUDA region %s after unregistering it; leaking its %d bytes "
                    "rather than freeing memory the server may write to",
                    pool.region_name,
                    pool.region_bytes,
                )
                pool.abandon()  # type: ignore[attr-defined]
                continue
            pool.close()
        self._pools.clear()


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
            import dataclasses

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
        self._pools: dict[str, SlotPool] = {}
        # Models without a slot layout (variable dims without maxima, BYTES in CUDA pools): why, per model.
        self._no_layout: dict[str, str] = {}
        self._signatures: dict[str, ModelSignature] = {}
        self._fallbacks: set[str] = set()  # models whose requests grpc_fallback sent over gRPC (logged once)
        self._lock = threading.Lock()
        self._model_locks: dict[str, threading.Lock] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._async_executor: ThreadPoolExecutor | None = None
        self._copier = BulkCopier(config.copy_threads or default_copy_threads())
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
            executors = (self._async_executor, self._executor)
            self._async_executor = self._executor = None
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=True)
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
        pool = self._pools.get(model)
        if pool is not None and not pool.retired:
            return pool
        with self._lock:
            if self._closed:
                raise PoolClosedError("the client is closed")
            model_lock = self._model_locks.setdefault(model, threading.Lock())
        with model_lock:
            pool = self._pools.get(model)
            if pool is None or pool.retired:
                # A retired pool (the model was reloaded with another configuration): its owner
                # grants one of the new layout; the old one stays with the source until idle.
                if pool is not None:
                    logger.info("pool of %r retired by its owner; taking the new layout's", model)
                    self._signatures.pop(model, None)
                pool = self._source.get_pool(model, self.config.pool_for(model))
                self._pools[model] = pool
        return pool

    def signature(self, model: str) -> ModelSignature:
        """Every input and output of ``model`` as its configuration declares them (no layout needed).

        Raises:
            TritonCallError: The server does not know the model.
        """
        signature = self._signatures.get(model)
        if signature is None:
            try:
                config = self._grpc.get_model_config(model, as_json=True)["config"]
            except InferenceServerException as e:
                raise translate_error(e, model) from e
            signature = self._signatures[model] = signature_from_config(config)
        return signature

    def shm_unavailable_reason(self, model: str) -> str | None:
        """Why ``model`` goes over plain gRPC rather than slots, or ``None`` if it has slots.

        Raises:
            TritonCallError: The server does not know the model.
        """
        return None if self._layout_or_none(model) is not None else self._no_layout[model]

    def verify_layout(self, layout: ModelLayout) -> None:
        """Check that the server still runs the model configuration ``layout`` was derived from.

        Raises:
            LayoutMismatchError: The model was reloaded with another configuration.
            TritonCallError: The server does not know the model (any more).
        """
        try:
            config = self._grpc.get_model_config(layout.model, as_json=True)["config"]
        except InferenceServerException as e:
            raise translate_error(e, layout.model) from e
        current = config_fingerprint(config)
        if layout.fingerprint and current != layout.fingerprint:
            self._signatures.pop(layout.model, None)
            raise LayoutMismatchError(layout.model, layout.fingerprint, current)

    def _layout_or_none(self, model: str) -> ModelLayout | None:
        """The model's slot layout, or ``None`` when it has none (the reason is logged once)."""
        if model in self._no_layout:
            return None
        pool = self._pools.get(model)
        if pool is not None and not pool.retired:
            return pool.layout
        try:
            return self.layout(model)
        except LayoutError as e:
            with self._lock:
                first = model not in self._no_layout
                self._no_layout[model] = str(e)
            if first:
                logger.warning("model %r has no shared-memory slot layout; plain gRPC it is: %s", model, e)
            return None

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
        return self._acquire(pool, self._lease_timeout(model, timeout))

    def _acquire(self, pool: SlotPool, timeout: float) -> Lease:
        started = time.perf_counter()
        try:
            lease = pool.acquire(timeout)
            if self._closed:  # close() has begun: it waits for requests in flight, starts none
                lease.release()
                raise PoolClosedError("the client is closed")
        except RayTritonShmError as e:
            safely(self._observer.error, pool.layout.model, type(e).__name__)
            raise
        safely(self._observer.lease_wait, pool.layout.model, time.perf_counter() - started)
        return lease

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
                result = _to_device(result, pool)
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
        chunks = _chunks(pool.layout, checked.batch)
        if len(chunks) == 1:
            outputs = self._run_chunk(pool, checked, chunks[0], wanted, lease_timeout, copy)
            return InferResult(outputs, path)
        executor = self._chunk_executor()
        futures = [
            executor.submit(self._run_chunk, pool, checked, chunk, wanted, lease_timeout) for chunk in chunks
        ]
        parts = [f.result() for f in futures]
        if pool.memory == "cuda":
            from ray_triton_shm._private.cuda import import_cupy

            cupy = import_cupy()
            with cupy.cuda.Device(pool.device):  # type: ignore[attr-defined]
                joined = {name: cupy.concatenate([p[name] for p in parts]) for name in wanted}
            return InferResult(joined, path)
        return InferResult({name: np.concatenate([p[name] for p in parts]) for name in wanted}, path)

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
            shapes = self._write_and_call(lease, checked, (0, checked.batch), wanted)
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

    def _chunk_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise PoolClosedError("the client is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.config.max_parallel_chunks, thread_name_prefix="rtshm-chunk"
                )
            return self._executor

    def _run_chunk(
        self,
        pool: SlotPool,
        checked: CheckedInputs,
        chunk: tuple[int, int],
        wanted: list[str],
        lease_timeout: float,
        copy: bool = True,
    ) -> dict[str, np.ndarray]:
        try:
            with self._acquire(pool, lease_timeout) as lease:
                shapes = self._write_and_call(lease, checked, chunk, wanted)
                if copy:
                    return {
                        name: lease.copy_output(name, shape, self._copier) for name, shape in shapes.items()
                    }
                return {name: lease.output(name, shape) for name, shape in shapes.items()}
        except PoolClosedError:
            raise
        except Exception as e:
            # close() from another thread freed the slot, unregistered the region or shut the
            # connection under this request: whatever that broke, the caller learns the one cause.
            if not self._closed:
                raise
            raise PoolClosedError("the client was closed while this request ran") from e

    def _write_and_call(
        self,
        lease: Lease,
        checked: CheckedInputs,
        chunk: tuple[int, int],
        wanted: list[str],
    ) -> dict[str, tuple[int, ...]]:
        start, stop = chunk
        layout = lease.layout
        shapes = {}
        for name, array in checked.arrays.items():
            part = array[start:stop] if layout.batched else array
            shapes[name] = lease.write_input(name, part, self._copier)
        return self._call_shm(lease, shapes, wanted)

    def _call_shm(
        self,
        lease: Lease,
        shapes: Mapping[str, tuple[int, ...]],
        wanted: Sequence[str] | None,
    ) -> dict[str, tuple[int, ...]]:
        layout = lease.layout
        region, base, size = lease.region_name, lease.offset, lease.pool.region_bytes
        inputs = []
        nbytes_in = 0
        for spec in layout.inputs:
            shape = tuple(shapes[spec.name])
            if spec.is_bytes:
                if spec.name not in lease.input_nbytes:
                    raise InputError(f"{spec.name}: a BYTES input must be written with write_input")
                nbytes = lease.input_nbytes[spec.name]  # Triton's serialised size, exactly
            else:
                nbytes = math.prod(shape) * spec.dtype.itemsize
            if nbytes > spec.capacity:
                raise InputError(f"{spec.name}: {nbytes} bytes do not fit its {spec.capacity} byte slot")
            check_span(region, size, base + spec.offset, nbytes)
            inputs.append(ShmInput(spec.name, shape, spec.datatype, region, nbytes, base + spec.offset))
            nbytes_in += nbytes
        names = list(wanted) if wanted is not None else [spec.name for spec in layout.outputs]
        outputs = []
        for name in names:
            spec = layout.output(name)
            if spec is None:
                raise InputError(f"model {layout.model!r} has no output {name!r}")
            check_span(region, size, base + spec.offset, spec.capacity)
            outputs.append(ShmOutput(name, region, spec.capacity, base + spec.offset, spec.datatype))
        lease.flush()
        started = time.perf_counter()
        reregister = getattr(self._source, "reregister", None)
        for attempt in (0, 1):
            try:
                shapes_out = self._send_shm(layout.model, inputs, outputs)
                break
            except TritonCallError as error:
                if error.status in IN_DOUBT_STATUSES:
                    lease.mark_in_doubt()
                # A restarted server has forgotten our region: register it again, once.
                if attempt == 0 and reregister is not None and region_unknown(error):
                    reregister(lease.pool)
                    continue
                safely(self._observer.error, layout.model, type(error).__name__)
                if error.status == "INVALID_ARGUMENT":
                    self.verify_layout(layout)  # a reloaded model: a typed error, not a puzzle
                raise
        seconds = time.perf_counter() - started
        nbytes = nbytes_in + sum(_output_nbytes(lease, name, shape) for name, shape in shapes_out.items())
        path = "cuda_shm" if lease.pool.memory == "cuda" else "shm"
        safely(self._observer.request, layout.model, path, nbytes, seconds)
        return shapes_out

    def _send_shm(
        self, model: str, inputs: Sequence[ShmInput], outputs: Sequence[ShmOutput]
    ) -> dict[str, tuple[int, ...]]:
        """One request whose tensors all lie in registered regions; returns the output shapes."""
        if self._http is not None:
            return self._http.infer(model, inputs, outputs)
        request_inputs = []
        for t in inputs:
            tensor = grpcclient.InferInput(t.name, list(t.shape), t.datatype)
            tensor.set_shared_memory(t.region, t.byte_size, offset=t.offset)
            request_inputs.append(tensor)
        request_outputs = []
        for t in outputs:
            tensor = grpcclient.InferRequestedOutput(t.name)
            tensor.set_shared_memory(t.region, t.byte_size, offset=t.offset)
            request_outputs.append(tensor)
        try:
            response = self._grpc.infer(
                model, request_inputs, outputs=request_outputs, client_timeout=self.config.request_timeout_s
            )
        except InferenceServerException as e:
            raise translate_error(e, model) from e
        shapes = {}
        for t in outputs:
            out = response.get_output(t.name)
            if out is None:
                raise TritonCallError(f"server returned no output {t.name!r}", None, model)
            check_datatype(t, out.datatype, model)  # another config than the layout's: not our bytes
            shapes[t.name] = tuple(int(d) for d in out.shape)
        return shapes

    def _call_grpc(self, model: str, checked: CheckedInputs, wanted: list[str]) -> dict[str, np.ndarray]:
        request_inputs = []
        for name, array in checked.arrays.items():
            if not isinstance(array, np.ndarray):  # a cupy array: plain gRPC sends host bytes
                from ray_triton_shm._private.cuda import import_cupy

                array = import_cupy().asnumpy(array)
            datatype = "BYTES" if array.dtype == object else NUMPY_TO_TRITON[array.dtype]
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(np.ascontiguousarray(array))
            request_inputs.append(tensor)
        request_outputs = [grpcclient.InferRequestedOutput(name) for name in wanted]
        started = time.perf_counter()
        try:
            response = self._grpc.infer(
                model,
                request_inputs,
                outputs=request_outputs,
                client_timeout=self.config.request_timeout_s,
            )
        except InferenceServerException as e:
            error = translate_error(e, model)
            safely(self._observer.error, model, type(error).__name__)
            raise error from e
        seconds = time.perf_counter() - started
        outputs = {name: response.as_numpy(name) for name in wanted}
        nbytes = checked.nbytes + sum(
            bytes_nbytes(a) if a.dtype == object else a.nbytes for a in outputs.values()
        )
        safely(self._observer.request, model, "grpc", nbytes, seconds)
        return outputs


def _output_nbytes(lease: Lease, name: str, shape: tuple[int, ...]) -> int:
    """Bytes Triton wrote for output ``name`` (a BYTES output's serialised size)."""
    spec = lease.layout.output(name)
    if spec.is_bytes:
        return serialized_size(lease.slot.arrays[name], math.prod(shape))
    return math.prod(shape) * spec.dtype.itemsize


def _to_device(outputs: dict[str, Any], pool: SlotPool) -> dict[str, Any]:
    """Host outputs as cupy arrays on a CUDA pool's GPU."""
    from ray_triton_shm._private.cuda import import_cupy

    cupy = import_cupy()
    with cupy.cuda.Device(pool.device):  # type: ignore[attr-defined]
        return {name: cupy.asarray(value) for name, value in outputs.items()}


def _chunks(layout: ModelLayout, batch: int) -> list[tuple[int, int]]:
    if not layout.batched:
        return [(0, 1)]
    step = layout.batch_capacity
    return [(start, min(start + step, batch)) for start in range(0, batch, step)]
