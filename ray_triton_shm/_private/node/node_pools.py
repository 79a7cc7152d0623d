"""Pools owned by a node actor and shared, slot by slot, by every client process on the node.

Pure Python (no Ray): the node actor wraps one :class:`NodePools`. Each pool
is a region registered with Triton plus a slot table (see
``_private/shm/slot_table.py``): a client process attaches both and takes a slot
only for as long as one request (or lease) needs it, so any number of
processes share a pool on demand. Slots whose user died mid-request, or whose
request timed out, are protected long enough for any request they left
running on the server to finish, so a reused slot never delivers a stale
result.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import PoolClosedError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """What a client process needs to use one model's pool.

    Attributes:
        model: Model name.
        segment_name: Segment to attach (``/dev/shm/<name>``); also the Triton region name.
        segment_size: Its size in bytes.
        layout: Placement of tensors in a slot.
        slots: Slot indices of the region (all of them: they are shared through ``table_name``).
        table_name: The pool's slot table segment.
        memory: ``"system"``, or ``"cuda"`` for a region in GPU memory.
        device_id: For CUDA: the region's GPU in the server's (and node actor's) numbering.
        cuda_handle: For CUDA: the region's 64-byte IPC handle, to open with ``cudaIpcOpenMemHandle``.
    """

    model: str
    segment_name: str
    segment_size: int
    layout: ModelLayout
    slots: tuple[int, ...]
    table_name: str
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
class ModelPool:
    """One model's region (a segment, or a :class:`CudaRegion`) and its slot table."""

    segment: Any
    layout: ModelLayout
    table: SlotTable


class NodePools:
    """Regions for each model and their slot tables, shared by the processes on this node.

    Pools are kept by key: the model name for its system-memory pool, or
    :func:`pool_key` of model and GPU for a CUDA pool (one per GPU).

    Args:
        register: Called with a region (a :class:`Segment` or :class:`CudaRegion`)
            to register it with Triton.
        unregister: Called with a region before it is freed; it must not be
            freed before Triton lets go of it.
        quarantine_s: How long slots of a process that died mid-request are held back.
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
        # Pools of a model's older configuration: freed once no process holds a slot of them.
        self._retired: list[ModelPool] = []
        self._lock = threading.Lock()
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

        A pool kept under ``key`` with another layout (the model was reloaded with another
        configuration) is retired (see :meth:`retire`) and a new one made for ``layout``.

        Args:
            model: Model name.
            layout: Its slot layout.
            config: Pool settings (slot count).
            key: Where the pool is kept; see :func:`pool_key`.
            make_region: Makes a region of the given size; default a new POSIX segment.

        Raises:
            PoolClosedError: Shutting down.
            SharedMemoryError: The region or its table could not be made.
        """
        key = key or model
        with self._lock:
            if self._closed:
                raise PoolClosedError("the node's pools are shut down")
            pool = self._pools.get(key)
            if pool is not None and pool.layout != layout:
                self._retire_locked(key)
                pool = None
            if pool is None:
                size = config.slots * layout.slot_bytes
                table = SlotTable.create(
                    new_segment_name("slots"), slots=config.slots, quarantine_s=self.quarantine_s
                )
                try:
                    region = (
                        make_region(size) if make_region else Segment.create(new_segment_name("node"), size)
                    )
                except BaseException:
                    table.close()
                    raise
                try:
                    self._register(region)
                except BaseException:
                    region.close()
                    table.close()
                    raise
                pool = ModelPool(region, layout, table)
                self._pools[key] = pool
                logger.info("pool %s: %d slots x %d bytes", key, config.slots, layout.slot_bytes)
            return pool

    def retire(self, model: str, layout: ModelLayout | None = None) -> int:
        """Retire ``model``'s pools whose layout is not ``layout`` (all of them for ``None``).

        A retired pool's users take no more slots of it (they see it in its slot table
        and ask for the new pool); it is unregistered and unlinked by :meth:`reap`
        once no process holds or protects a slot of it. Returns how many were retired.
        """
        with self._lock:
            keys = [k for k, p in self._pools.items() if p.layout.model == model and p.layout != layout]
            for key in keys:
                self._retire_locked(key)
        return len(keys)

    def _retire_locked(self, key: str) -> None:
        pool = self._pools.pop(key)
        pool.table.retire()
        self._retired.append(pool)
        logger.info(
            "pool %s retired (layout of config %s); freed once its slots are", key, pool.layout.fingerprint
        )

    def reap(self) -> int:
        """Unregister and unlink retired pools no process holds a slot of. Returns how many."""
        with self._lock:
            idle = [p for p in self._retired if not _busy(p.table.state())]
            self._retired = [p for p in self._retired if p not in idle]
        for pool in idle:
            self._free(pool)
        return len(idle)

    def retired_count(self) -> int:
        """Retired pools still waiting for their slots to be let go."""
        with self._lock:
            return len(self._retired)

    def _free(self, pool: ModelPool) -> None:
        try:
            self._unregister(pool.segment)
        except Exception as e:  # the server may already be gone
            logger.debug("unregister %s failed: %s", pool.segment.name, e)
        pool.segment.close()
        pool.table.close()

    def register_all(self) -> None:
        """Register every region again (after Triton restarted)."""
        with self._lock:
            for pool in self._pools.values():
                self._register(pool.segment)

    def grant(self, model: str, *, key: str | None = None) -> Grant:
        """What a client needs to use ``model``'s pool (kept under ``key``).

        Raises:
            PoolClosedError: Shutting down.
            KeyError: ``ensure_pool`` was not called for ``model``.
        """
        with self._lock:
            if self._closed:
                raise PoolClosedError("the node's pools are shut down")
            pool = self._pools[key or model]
        region = pool.segment
        cuda = getattr(region, "memory", "system") == "cuda"
        return Grant(
            model,
            region.name,
            region.size,
            pool.layout,
            tuple(range(pool.table.slots)),
            pool.table.name,
            memory="cuda" if cuda else "system",
            device_id=region.server_device if cuda else -1,
            cuda_handle=region.buffer.handle if cuda else b"",
        )

    def sweep(self) -> int:
        """Quarantine slots whose user died mid-lease (see :meth:`SlotTable.sweep`). Returns how many."""
        with self._lock:
            pools = list(self._pools.values())
            retired = list(self._retired)
        found = sum(pool.table.sweep() for pool in pools + retired)
        if found:
            logger.warning("%d slot(s) of dead processes held back %gs", found, self.quarantine_s)
        if retired:
            self.reap()
        return found

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: slots, free, in use (by any process), quarantined, slot bytes."""
        with self._lock:
            pools = dict(self._pools)
        out = {}
        for key, pool in pools.items():
            state = pool.table.state()
            out[key] = {
                "slots": pool.table.slots,
                "free": state["free"],
                "in_use": state["in_use"],
                "quarantined": state["protected"],
                "slot_bytes": pool.layout.slot_bytes,
            }
        return out

    def close(self) -> None:
        """Unregister, then unlink every region and table (free every GPU region). Idempotent.

        Call it after Triton stopped (the node actor does): then no request
        can still write to a region, whatever the slot tables say.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools, self._pools = self._pools, {}
            retired, self._retired = self._retired, []
        for pool in [*pools.values(), *retired]:
            self._free(pool)


def _busy(state: dict[str, int]) -> bool:
    return state["in_use"] > 0 or state["protected"] > 0


def pool_key(model: str, memory: str = "system", device_id: int = -1) -> str:
    """The key of ``model``'s pool: the model name for system memory, ``model@cuda:<id>`` for a GPU."""
    return model if memory == "system" else f"{model}@cuda:{device_id}"
