"""A client's requests through its slots: lease, write the inputs, call, read the outputs.

Batches larger than a slot are split into chunks that run concurrently across slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.bulk_copy import BulkCopier
from ray_triton_shm._private.shm.cuda import import_cupy
from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.validate import CheckedInputs
from ray_triton_shm._private.triton.observe import Observer, safely
from ray_triton_shm._private.triton.triton_requests import TritonRequests
from ray_triton_shm.errors import PoolClosedError, RayTritonShmError


class SlotRunner:
    """Runs checked inputs through one client's slots.

    Args:
        requests: Sends the requests whose tensors lie in the slots.
        observer: Told about every lease wait and error.
        copier: Copies tensors into and out of slots.
        max_parallel_chunks: Threads that run the chunks of a split batch.
        is_closed: Whether the client's ``close()`` has begun: from then on no
            request starts, and whatever a close breaks under a running
            request surfaces as :class:`PoolClosedError`.
    """

    def __init__(
        self,
        requests: TritonRequests,
        observer: Observer,
        copier: BulkCopier,
        max_parallel_chunks: int,
        is_closed: Callable[[], bool],
    ) -> None:
        self._requests = requests
        self._observer = observer
        self._copier = copier
        self._max_parallel_chunks = max_parallel_chunks
        self._is_closed = is_closed
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Wait for the chunks in flight and stop their threads (call once the client is closed)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def acquire(self, pool: SlotPool, timeout: float) -> Lease:
        """Lease a slot of ``pool``, waiting up to ``timeout`` seconds.

        Raises:
            PoolTimeoutError: No slot became free in time.
            PoolClosedError: The pool or the client is closed.
        """
        started = time.perf_counter()
        try:
            lease = pool.acquire(timeout)
            if self._is_closed():  # close() has begun: it waits for requests in flight, starts none
                lease.release()
                raise PoolClosedError("the client is closed")
        except RayTritonShmError as e:
            safely(self._observer.error, pool.layout.model, type(e).__name__)
            raise
        safely(self._observer.lease_wait, pool.layout.model, time.perf_counter() - started)
        return lease

    def run(
        self,
        pool: SlotPool,
        checked: CheckedInputs,
        wanted: list[str],
        lease_timeout: float,
        copy: bool = True,
    ) -> dict[str, Any]:
        """Run ``checked`` through slots of ``pool``, split into chunks a slot holds; returns the outputs.

        Raises:
            PoolTimeoutError / TritonCallError / OutputTooLargeError: As for ``TritonShmClient.infer``.
            PoolClosedError: The client is closed, or was closed during the call.
        """
        batches = chunks(pool.layout, checked.batch)
        if len(batches) == 1:
            return self.run_chunk(pool, checked, batches[0], wanted, lease_timeout, copy)
        executor = self._chunk_executor()
        futures = [
            executor.submit(self.run_chunk, pool, checked, chunk, wanted, lease_timeout) for chunk in batches
        ]
        return join_chunks([f.result() for f in futures], wanted, pool)

    def _chunk_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._is_closed():
                raise PoolClosedError("the client is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self._max_parallel_chunks, thread_name_prefix="rtshm-chunk"
                )
            return self._executor

    def run_chunk(
        self,
        pool: SlotPool,
        checked: CheckedInputs,
        chunk: tuple[int, int],
        wanted: list[str],
        lease_timeout: float,
        copy: bool = True,
    ) -> dict[str, np.ndarray]:
        """Run rows ``chunk`` of ``checked`` through one slot; returns copies of the outputs, or views.

        Raises:
            As :meth:`run`.
        """
        try:
            with self.acquire(pool, lease_timeout) as lease:
                shapes = self.write_and_call(lease, checked, chunk, wanted)
                return read_outputs(lease, shapes, self._copier, copy)
        except PoolClosedError:
            raise
        except Exception as e:
            # close() from another thread freed the slot, unregistered the region or shut the
            # connection under this request: whatever that broke, the caller learns the one cause.
            if not self._is_closed():
                raise
            raise PoolClosedError("the client was closed while this request ran") from e

    def write_and_call(
        self,
        lease: Lease,
        checked: CheckedInputs,
        chunk: tuple[int, int],
        wanted: list[str],
    ) -> dict[str, tuple[int, ...]]:
        """Write rows ``chunk`` of ``checked`` into ``lease``'s slot and run the model; returns output shapes.

        Raises:
            InputError / TritonCallError: As ``TritonRequests.call_shm``.
        """
        return self._requests.call_shm(lease, write_inputs(lease, checked, chunk, self._copier), wanted)


def chunks(layout: ModelLayout, batch: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` rows of a batch of ``batch`` rows that each go through one slot."""
    if not layout.batched:
        return [(0, 1)]
    step = layout.batch_capacity
    return [(start, min(start + step, batch)) for start in range(0, batch, step)]


def write_inputs(
    lease: Lease, checked: CheckedInputs, chunk: tuple[int, int], copier: BulkCopier
) -> dict[str, tuple[int, ...]]:
    """Write rows ``chunk`` of every input into ``lease``'s slot; returns the shapes written.

    Raises:
        InputError: A tensor does not fit its region of the slot.
        LeaseReleasedError / PoolClosedError: The lease ended or its pool was closed.
    """
    start, stop = chunk
    batched = lease.layout.batched
    shapes = {}
    for name, array in checked.arrays.items():
        part = array[start:stop] if batched else array
        shapes[name] = lease.write_input(name, part, copier)
    return shapes


def read_outputs(
    lease: Lease, shapes: dict[str, tuple[int, ...]], copier: BulkCopier, copy: bool
) -> dict[str, np.ndarray]:
    """The outputs of ``shapes`` in ``lease``'s slot: copies, or read-only views when ``copy`` is off.

    Raises:
        LeaseReleasedError / PoolClosedError: The lease ended or its pool was closed.
        TritonCallError: A BYTES output's lengths run past its region.
    """
    if copy:
        return {name: lease.copy_output(name, shape, copier) for name, shape in shapes.items()}
    return {name: lease.output(name, shape) for name, shape in shapes.items()}


def join_chunks(parts: Sequence[dict[str, Any]], wanted: list[str], pool: SlotPool) -> dict[str, Any]:
    """The outputs of a batch's chunks joined in order (cupy arrays on a CUDA pool's GPU)."""
    if pool.memory == "cuda":
        cupy = import_cupy()
        with cupy.cuda.Device(pool.device):  # type: ignore[attr-defined]
            return {name: cupy.concatenate([p[name] for p in parts]) for name in wanted}
    return {name: np.concatenate([p[name] for p in parts]) for name in wanted}


def to_device(outputs: dict[str, Any], pool: SlotPool) -> dict[str, Any]:
    """Host outputs as cupy arrays on a CUDA pool's GPU."""
    cupy = import_cupy()
    with cupy.cuda.Device(pool.device):  # type: ignore[attr-defined]
        return {name: cupy.asarray(value) for name, value in outputs.items()}
