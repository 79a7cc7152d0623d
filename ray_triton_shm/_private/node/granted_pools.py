"""The node's pools as one client process sees them: granted by the node actor, attached here.

A :class:`GrantedPools` is the ``PoolSource`` of a :class:`NodeClient`'s core
client: the first use of a model asks the node actor for a grant of that
model's pool (``acquire``), attaches its segment (or CUDA buffer) and its slot
table, and shares the pool slot by slot with every process on the node. Pools
the node retired (their model was reloaded) are unmapped here once idle.
"""

from __future__ import annotations

import logging
import os
import time

import ray

from ray_triton_shm._private.node.node_config import CVD, NodeInfo
from ray_triton_shm._private.node.node_pools import Grant
from ray_triton_shm._private.shm.cuda import DeviceBuffer, require_device
from ray_triton_shm._private.shm.cuda_devices import server_device_id
from ray_triton_shm._private.shm.cuda_pool import CudaSlotPool
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import DeviceMappingError, SharedMemoryError

logger = logging.getLogger(__name__)

# How long a pool the node retired stays mapped in this process after it was first seen retired:
# a thread that took it just before may still be about to lease (and be told it is retired).
_RETIRED_GRACE_S = 30.0


class GrantedPools:
    """A client's :class:`PoolSource`: the node's pools, shared with every process on the node."""

    def __init__(
        self,
        actor: ray.actor.ActorHandle,
        max_in_use: int | None,
        info: NodeInfo | None = None,
        force_cuda: bool = False,
    ) -> None:
        self._actor = actor
        self._max_in_use = max_in_use
        self._info = info
        self._force_cuda = force_cuda
        self._held: list[SlotPool] = []
        # Pools the node retired (their model was reloaded), with when this process first saw it.
        self._retired: dict[int, float] = {}

    def _server_device(self, config: PoolConfig) -> tuple[int, int] | None:
        """(this process's GPU, Triton's id for it) when the pool should be in GPU memory.

        Under ``memory="auto"`` a GPU that Triton cannot be told about (not
        visible to it, or not comparable) means system memory, not an error.

        Raises:
            DeviceMappingError: With ``memory="cuda"``, Triton does not see this process's GPU.
        """
        if config.memory != "cuda":
            return None

        local = require_device(config.device_id)
        visible = self._info.gpu_visible_devices if self._info else None
        try:
            return local, server_device_id(local, os.environ.get(CVD), visible)
        except DeviceMappingError as e:
            if self._force_cuda:
                raise
            logger.warning("memory='auto': system memory, since Triton cannot be given this GPU: %s", e)
            return None

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        self._close_retired()
        try:
            return self._get_pool(model, config)
        except SharedMemoryError:
            # The pool granted was retired (its model reloaded) and freed before we attached it.
            return self._get_pool(model, config)

    def _close_retired(self) -> None:
        """Unmap pools the node retired once they have been idle here for a while."""
        now = time.monotonic()
        for pool in [p for p in self._held if p.retired]:
            seen = self._retired.setdefault(id(pool), now)
            stats = pool.stats()
            if now - seen >= _RETIRED_GRACE_S and stats.busy == stats.pinned == stats.quarantined == 0:
                self._held.remove(pool)
                del self._retired[id(pool)]
                pool.close()

    def _get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        devices = self._server_device(config)
        request = self._actor.acquire.remote(model, devices[1] if devices else None, self._force_cuda)
        grant: Grant = ray.get(request)
        table = SlotTable.attach(grant.table_name)
        try:
            quarantine_s = table.quarantine_ns / 1e9
            if grant.memory == "cuda" and devices is not None:
                buffer = DeviceBuffer.open(grant.cuda_handle, grant.segment_size, devices[0])
                pool: SlotPool = CudaSlotPool(
                    buffer, grant.segment_name, grant.layout, grant.slots, quarantine_s=quarantine_s
                )
            else:
                if devices is not None:
                    logger.info("node gave %s a system-memory pool (model not on GPU or no GPUs)", model)
                segment = Segment.attach(grant.segment_name, grant.segment_size)
                pool = SlotPool(segment, grant.layout, grant.slots, quarantine_s=quarantine_s)
        except BaseException:
            table.close()
            raise
        pool.share(table, self._max_in_use)
        self._held.append(pool)
        return pool

    def close(self) -> None:
        held, self._held = self._held, []
        self._retired.clear()
        for pool in held:
            pool.close()
