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
from dataclasses import dataclass, field

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
    """

    grant_id: str
    model: str
    segment_name: str
    segment_size: int
    layout: ModelLayout
    slots: tuple[int, ...]


@dataclass
class _Owner:
    pid: int
    start_time: int | None
    slots: tuple[int, ...]


@dataclass
class ModelPool:
    """One model's segment and who holds which slot."""

    segment: Segment
    layout: ModelLayout
    free: list[int]
    grants: dict[str, _Owner] = field(default_factory=dict)
    quarantined: list[tuple[int, float]] = field(default_factory=list)
    bytes_granted: int = 0


class NodePools:
    """Segments for each model, and grants of their slots to processes on this node.

    Args:
        register: Called with (region name, key, size) to register a segment with Triton.
        unregister: Called with a region name before a segment is unlinked.
        quarantine_s: How long slots of a dead process are held back.
    """

    def __init__(self, register, unregister, *, quarantine_s: float) -> None:
        self._register = register
        self._unregister = unregister
        self.quarantine_s = quarantine_s
        self._pools: dict[str, ModelPool] = {}
        self._cond = threading.Condition()
        self._closed = False

    def ensure_pool(self, model: str, layout: ModelLayout, config: PoolConfig) -> ModelPool:
        """Create and register ``model``'s segment if it has none yet."""
        with self._cond:
            pool = self._pools.get(model)
            if pool is None:
                segment = Segment.create(new_segment_name("node"), config.slots * layout.slot_bytes)
                try:
                    self._register(segment.name, segment.key, segment.size)
                except BaseException:
                    segment.close()
                    raise
                pool = ModelPool(segment, layout, list(range(config.slots)))
                self._pools[model] = pool
                logger.info("pool for %s: %d slots x %d bytes", model, config.slots, layout.slot_bytes)
            return pool

    def register_all(self) -> None:
        """Register every segment again (after Triton restarted)."""
        with self._cond:
            for pool in self._pools.values():
                self._register(pool.segment.name, pool.segment.key, pool.segment.size)

    def acquire(self, model: str, want: int, owner_pid: int, timeout: float) -> Grant:
        """Grant up to ``want`` (at least one) free slots of ``model`` to ``owner_pid``.

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
                pool = self._pools[model]
                self._reclaim_locked(pool)
                if pool.free:
                    take = tuple(pool.free[: max(1, want)])
                    del pool.free[: len(take)]
                    grant_id = uuid.uuid4().hex
                    pool.grants[grant_id] = _Owner(owner_pid, process_start_time(owner_pid), take)
                    return Grant(grant_id, model, pool.segment.name, pool.segment.size, pool.layout, take)
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
                model: {
                    "slots": pool.segment.size // pool.layout.slot_bytes,
                    "free": len(pool.free),
                    "granted": sum(len(o.slots) for o in pool.grants.values()),
                    "quarantined": len(pool.quarantined),
                    "owners": len(pool.grants),
                    "slot_bytes": pool.layout.slot_bytes,
                }
                for model, pool in self._pools.items()
            }

    def close(self) -> None:
        """Unregister, then unlink every segment. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            try:
                self._unregister(pool.segment.name)
            except Exception as e:  # the server may already be gone
                logger.debug("unregister %s failed: %s", pool.segment.name, e)
            pool.segment.close()
