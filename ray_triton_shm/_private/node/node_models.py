"""The node actor's models: their configurations as Triton serves them, their pools, model control.

:class:`NodeModels` is the part of the node actor (``node_actor._NodeActor``)
that knows the node's models: it fetches a model's configuration from Triton
(kept until a load, unload, restart or a client's report of a changed
layout), creates the model's pool of that layout (a CUDA one where the node,
the model and the caller allow it), and loads, unloads and reloads models on
Triton with explicit model control, retiring the pools of a layout no longer
served.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.node.node_config import CVD, NodeConfig
from ray_triton_shm._private.node.node_pools import CudaRegion, NodePools, pool_key
from ray_triton_shm._private.shm.cuda import DeviceBuffer, local_device_uuids
from ray_triton_shm._private.shm.cuda_devices import local_device_index
from ray_triton_shm._private.shm.layout import config_fingerprint, layout_from_config
from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import LayoutError, TritonCallError, UnavailableError

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
"""Longest a control call to Triton (model config, region registration) may take: a hung
Triton must not hold a caller (or the actor's lock) longer than this."""


class NodeModels:
    """The node actor's models (see the module docstring); mixed into the actor's class.

    The actor sets these attributes and has ``_require_healthy`` (raises while Triton
    is restarting).
    """

    config: NodeConfig
    _grpc: Any
    _lock: threading.RLock
    _pools: NodePools
    _configs: dict[str, dict[str, Any]]
    _gpu_count: int
    _gpu_visible: str | None

    def _ensure_pool(self, model: str, device: int | None = None, force_cuda: bool = False) -> str:
        """Create ``model``'s pool (a CUDA one on Triton's GPU ``device`` if allowed); return its key."""
        pool_config = self.config.pool_for(model)
        model_config = self._configs.get(model)
        if model_config is None:
            model_config = self._configs[model] = self._model_config(model)
        layout = layout_from_config(model_config, pool_config)
        # Strings are host objects whatever the model runs on: BYTES models get system memory.
        has_bytes = any(spec.is_bytes for spec in (*layout.inputs, *layout.outputs))
        if device is None or has_bytes or not self._cuda_allowed(model_config, pool_config, force_cuda):
            self._pools.ensure_pool(model, layout, pool_config)
            return model
        key = pool_key(model, "cuda", device)
        local = self._local_device(device)

        def make_region(size: int) -> CudaRegion:
            return CudaRegion(DeviceBuffer.allocate(size, local), new_segment_name("ncuda"), device)

        self._pools.ensure_pool(model, layout, pool_config, key=key, make_region=make_region)
        return key

    def _model_config(self, model: str) -> dict[str, Any]:
        self._require_healthy()
        timeout = CONTROL_TIMEOUT_S
        try:
            return self._grpc.get_model_config(model, as_json=True, client_timeout=timeout)["config"]
        except InferenceServerException as e:
            raise translate_error(e, model) from e

    def _cuda_allowed(self, model_config: Mapping[str, Any], pool: PoolConfig, force: bool) -> bool:
        if self._gpu_count == 0 or self.config.cuda_pools == "never":
            return False
        return (
            self.config.cuda_pools == "always" or force or pool.memory == "cuda" or runs_on_gpu(model_config)
        )

    def _local_device(self, server_device: int) -> int:
        """This actor's index of the GPU Triton calls ``server_device``.

        Raises:
            DeviceMappingError: No GPU of this actor is that GPU of Triton.
        """
        return local_device_index(
            server_device,
            os.environ.get(CVD),
            self._gpu_visible,
            self._gpu_count,
            local_uuids=local_device_uuids(),
        )

    def load_model(self, model: str, config_json: str | None = None) -> dict[str, Any]:
        """Load or reload ``model`` on this node's Triton (explicit model control).

        Args:
            model: Model name in the repository.
            config_json: A model configuration (JSON) to load instead of the repository's.

        Returns:
            ``{"model": ..., "fingerprint": ...}``: the fingerprint of the configuration now served;
            clients' slot layouts of an older one are refused with ``LayoutMismatchError``.

        Raises:
            TritonCallError: Triton refused (e.g. not started with explicit model control).
        """
        try:
            self._grpc.load_model(model, config=config_json)
        except InferenceServerException as e:
            raise translate_error(e, model) from e
        fingerprint = self.layout_changed(model)
        logger.info("loaded %s (config %s)", model, fingerprint)
        return {"model": model, "fingerprint": fingerprint}

    def unload_model(self, model: str) -> dict[str, Any]:
        """Unload ``model`` from this node's Triton (explicit model control).

        Raises:
            TritonCallError: Triton refused.
        """
        try:
            self._grpc.unload_model(model)
        except InferenceServerException as e:
            raise translate_error(e, model) from e
        with self._lock:
            self._configs.pop(model, None)
            self._pools.retire(model)
        self._pools.reap()
        logger.info("unloaded %s", model)
        return {"model": model, "fingerprint": None}

    def layout_changed(self, model: str) -> str | None:
        """Fetch ``model``'s config again; retire its pools of another layout (a client found it changed).

        The retired pools' users see it in their slot tables and take a grant of the
        new layout; the old regions are unregistered and unlinked once no process
        holds a slot of them.

        Returns:
            The fingerprint of the config now served, or ``None`` if Triton does not serve the model.

        Raises:
            UnavailableError: Triton is restarting or does not answer.
        """
        with self._lock:
            self._configs.pop(model, None)
            try:
                model_config = self._configs[model] = self._model_config(model)
            except UnavailableError:
                raise  # Triton restarting: nothing is known about the model's config
            except TritonCallError:  # not served (unloaded, or failed to load)
                self._pools.retire(model)
                fingerprint = None
            else:
                try:
                    layout = layout_from_config(model_config, self.config.pool_for(model))
                except LayoutError:
                    layout = None  # no slots any more: clients go over gRPC
                self._pools.retire(model, layout)
                fingerprint = config_fingerprint(model_config)
        self._pools.reap()
        return fingerprint


def runs_on_gpu(model_config: Mapping[str, Any]) -> bool:
    """Whether Triton runs some instance of the model on a GPU (instance_group kind GPU)."""
    groups = model_config.get("instance_group") or []
    return any(str(group.get("kind", "")).endswith("GPU") for group in groups)
