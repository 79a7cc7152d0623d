"""Slot pools a client creates itself and registers with its Triton (no Ray node actor)."""

from __future__ import annotations

import logging
import os
import threading
import time

from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.shm.cuda_devices import server_device_id, server_visible_devices_of
from ray_triton_shm._private.shm.cuda_pool import CudaSlotPool
from ray_triton_shm._private.shm.layout import ModelLayout, layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import check_span, redact
from ray_triton_shm._private.triton.call_errors import status_name, translate_error
from ray_triton_shm._private.triton.grpc_channel import GrpcClient, unregister_region
from ray_triton_shm._private.triton.server_launch import SHM_API_GRPC_HEADER
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import CudaError, PoolClosedError, TritonCallError

# The client's messages, under the client's logger name wherever they are written.
logger = logging.getLogger("ray_triton_shm.client")

_UNREGISTER_WAIT_S = 5.0


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


class LocalPools:
    """Pools created and registered with Triton by this process."""

    def __init__(
        self,
        grpc: GrpcClient,
        server_visible_devices: str | None = None,
        shm_api_key: str | None = None,
        url: str = "",
    ) -> None:
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
            if status_name(e) == "ALREADY_EXISTS":
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
        try:
            unregister_region(
                self._grpc, pool.region_name, pool.memory == "cuda", _UNREGISTER_WAIT_S, headers=self._headers
            )
        except InferenceServerException as e:
            # The server may be gone already; whether a CUDA region may be freed is
            # decided by _cuda_region_gone.
            logger.debug("unregister %s failed: %s", pool.region_name, e)

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
                if status_name(e) in ("NOT_FOUND", "UNAVAILABLE") or "unable to find" in message:
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
