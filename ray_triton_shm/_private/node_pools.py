"""Pools owned by a node actor and granted, slot by slot, to client processes.

Pure Python (no Ray): the node actor wraps one :class:`NodePools`. A grant
gives a client process a few slots of a model's segment for as long as that
process lives; slots of processes that died come back after a quarantine
long enough for any request they left running on the server to finish, so a
reused slot never delivers a stale result.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.layout import ModelLayout
from ray_triton_shm._private.segment import Segment, new_segment_name, process_start_time
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import PoolClosedError, PoolTimeoutError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """Slots of one model lent to one client process.

    Attributes:
        grant_id: Identifies the grant for :meth:`NodePools.release`.
        model: Model name.
        segment_name: Segment to attach (``/dev/shm/<name>``); also the Triton region name.
        segment_size: Its size in bytes.
        layout: Placement of tensors in a slot.
        slots: Slot indices the client may use.
        memory: ``"system"``, or ``"cuda"`` for a region in GPU memory.
        device_id: For CUDA: the region's GPU in the server's (and node actor's) numbering.
        cuda_handle: For CUDA: the region's 64-byte IPC handle, to open with ``cudaIpcOpenMemHandle``.
    """

    grant_id: str
    model: str
    segment_name: str
    segment_size: int
    layout: ModelLayout
    slots: tuple[int, ...]
    memory: str = "system"
    device_id: int = -1
    cuda_handle: bytes = b""


class CudaRegion:
    """A node-owned region in GPU memory, with the interface NodePools needs of a segment.

    Args:
        buffer: The raw allocation (a ``cuda.DeviceBuffer`` owned by the node actor).
        name: Its name in Triton.
        server_device: Its GPU in Triton's numbering.
    """

    memory = "cuda"

    def __init__(self, buffer: Any, name: str, server_device: int) -> None:
        self.buffer = buffer
        self.name = name
        self.size = buffer.size
        self.server_device = server_device

    def close(self) -> None:
        self.buffer.close()


@dataclass
class _Owner:
    pid: int
    start_time: int | None
    slots: tuple[int, ...]


@dataclass
class ModelPool:
    """One model's region (a segment, or a :class:`CudaRegion`) and who holds which slot."""

    segment: Any
    layout: ModelLayout
    free: list[int]
    grants: dict[str, _Owner] = field(default_factory=dict)
    quarantined: list[tuple[int, float]] = field(default_factory=list)
    bytes_granted: int = 0


class NodePools:
    """Segments for each model, and grants of their slots to processes on this node.

    Pools are kept by key: the model name for its system-memory pool, or
    :func:`pool_key` of model and GPU for a CUDA pool (one per GPU).

    Args:
        register: Called with a region (a :class:`Segment` or :class:`CudaRegion`)
            to register it with Triton.
        unregister: Called with a region before it is freed; it must not be
            freed before Triton lets go of it.
        quarantine_s: How long slots of a dead process are held back.
    """

    def __init__(
        self,
        register: Callable[[Any], None],
        unregister: Callable[[Any], None],
        *,
        quarantine_s: float,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self.quarantine_s = quarantine_s
        self._pools: dict[str, ModelPool] = {}
        self._cond = threading.Condition()
        self._closed = False

    def ensure_pool(
        self,
        model: str,
        layout: ModelLayout,
        config: PoolConfig,
        *,
        key: str | None = None,
        make_region: Callable[[int], Any] | None = None,
    ) -> ModelPool:
        """Create and register a pool for ``model`` under ``key`` (default: the model) if there is none.

        Args:
            model: Model name.
            layout: Its slot layout.
            config: Pool settings (slot count).
            key: Where the pool is kept; see :func:`pool_key`.
            make_region: Makes a region of the given size; default a new POSIX segment.
        """
        key = key or model
        with self._cond:
            pool = self._pools.get(key)
            if pool is None:
                size = config.slots * layout.slot_bytes
                region = make_region(size) if make_region else Segment.create(new_segment_name("node"), size)
                try:
                    self._register(region)
                except BaseException:
                    region.close()
                    raise
                pool = ModelPool(region, layout, list(range(config.slots)))
                self._pools[key] = pool
                logger.info("pool %s: %d slots x %d bytes", key, config.slots, layout.slot_bytes)
            return pool

    def register_all(self) -> None:
        """Register every segment again (after Triton restarted)."""
        with self._cond:
            for pool in self._pools.values():
                self._register(pool.segment)

    def acquire(
        self, model: str, want: int, owner_pid: int, timeout: float, *, key: str | None = None
    ) -> Grant:
        """Grant up to ``want`` (at least one) free slots of ``model`` (pool ``key``) to ``owner_pid``.

        Raises:
            PoolTimeoutError: No slot became free within ``timeout``.
            PoolClosedError: Shutting down.
            KeyError: ``ensure_pool`` was not called for ``model``.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("the node's pools are shut down")
                pool = self._pools[key or model]
                self._reclaim_locked(pool)
                if pool.free:
                    take = tuple(pool.free[: max(1, want)])
                    del pool.free[: len(take)]
                    grant_id = uuid.uuid4().hex
                    pool.grants[grant_id] = _Owner(owner_pid, process_start_time(owner_pid), take)
                    region = pool.segment
                    cuda = getattr(region, "memory", "system") == "cuda"
                    return Grant(
                        grant_id,
                        model,
                        region.name,
                        region.size,
                        pool.layout,
                        take,
                        memory="cuda" if cuda else "system",
                        device_id=region.server_device if cuda else -1,
                        cuda_handle=region.buffer.handle if cuda else b"",
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PoolTimeoutError(model, timeout)
                self._cond.wait(min(remaining, 0.2))

    def release(self, grant_id: str) -> bool:
        """Return a grant's slots at once (its owner says it is done with them)."""
        with self._cond:
            for pool in self._pools.values():
                owner = pool.grants.pop(grant_id, None)
                if owner is not None:
                    pool.free.extend(owner.slots)
                    self._cond.notify_all()
                    return True
        return False

    def reclaim(self) -> int:
        """Quarantine slots of dead owners and free those whose quarantine ended.

        Returns:
            Slots of dead owners found in this pass.
        """
        with self._cond:
            found = sum(self._reclaim_locked(pool) for pool in self._pools.values())
            self._cond.notify_all()
            return found

    def _reclaim_locked(self, pool: ModelPool) -> int:
        found = 0
        for grant_id, owner in list(pool.grants.items()):
            if process_start_time(owner.pid) != owner.start_time:
                del pool.grants[grant_id]
                until = time.monotonic() + self.quarantine_s
                pool.quarantined.extend((slot, until) for slot in owner.slots)
                found += len(owner.slots)
                logger.warning(
                    "process %d died holding %d slot(s) of %s; reclaimed after %gs",
                    owner.pid,
                    len(owner.slots),
                    pool.layout.model,
                    self.quarantine_s,
                )
        now = time.monotonic()
        pool.free.extend(slot for slot, until in pool.quarantined if until <= now)
        pool.quarantined = [(slot, until) for slot, until in pool.quarantined if until > now]
        return found

    def stats(self) -> dict[str, dict[str, int]]:
        """Per model: slots, free, granted, quarantined, owners, slot bytes."""
        with self._cond:
            return {
                key: {
                    "slots": pool.segment.size // pool.layout.slot_bytes,
                    "free": len(pool.free),
                    "granted": sum(len(o.slots) for o in pool.grants.values()),
                    "quarantined": len(pool.quarantined),
                    "owners": len(pool.grants),
                    "slot_bytes": pool.layout.slot_bytes,
                }
                for key, pool in self._pools.items()
            }

    def close(self) -> None:
        """Unregister, then unlink every segment (free every GPU region). Idempotent.

        A GPU region with slots still in quarantine (their owner died, a request
        may still run on the server) is freed only when the quarantine ends.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            if isinstance(pool.segment, CudaRegion) and pool.quarantined:
                wait = max(until for _, until in pool.quarantined) - time.monotonic()
                if wait > 0:
                    logger.warning(
                        "waiting %.1fs before freeing %s: requests may be in flight", wait, pool.segment.name
                    )
                    time.sleep(wait)
            try:
                self._unregister(pool.segment)
            except Exception as e:  # the server may already be gone
                logger.debug("unregister %s failed: %s", pool.segment.name, e)
            pool.segment.close()


def pool_key(model: str, memory: str = "system", device_id: int = -1) -> str:
    """The key of ``model``'s pool: the model name for system memory, ``model@cuda:<id>`` for a GPU."""
    return model if memory == "system" else f"{model}@cuda:{device_id}"
