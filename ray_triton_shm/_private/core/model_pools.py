"""A client's slot pools by model, and what it learned of each model's configuration."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.shm.layout import (
    ModelLayout,
    ModelSignature,
    config_fingerprint,
    signature_from_config,
)
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm._private.triton.grpc_channel import GrpcClient
from ray_triton_shm.config import ClientConfig, PoolConfig
from ray_triton_shm.errors import LayoutError, LayoutMismatchError, PoolClosedError

# The client's messages, under the client's logger name wherever they are written.
logger = logging.getLogger("ray_triton_shm.client")


class PoolSource(Protocol):
    """Where a client gets its slot pools (created here, or granted by a Ray node actor).

    A pool carries the layout it was built with; the client validates against it.
    """

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool: ...

    def close(self) -> None: ...


class ModelPools:
    """The pools one client uses, taken from its pool source on first use, and each model's signature.

    Args:
        source: Supplies the pools.
        grpc: The client's connection (model configurations).
        config: The client's configuration (each model's pool config).
        lock: The client's lock, which guards ``is_closed``.
        is_closed: Whether the client is closed: no pool is taken then.
    """

    def __init__(
        self,
        source: PoolSource,
        grpc: GrpcClient,
        config: ClientConfig,
        lock: threading.Lock,
        is_closed: Callable[[], bool],
    ) -> None:
        self._source = source
        self._grpc = grpc
        self._config = config
        self._lock = lock
        self._is_closed = is_closed
        self.pools: dict[str, SlotPool] = {}
        # Models without a slot layout (variable dims without maxima, BYTES in CUDA pools): why, per model.
        self.no_layout: dict[str, str] = {}
        self._signatures: dict[str, ModelSignature] = {}
        self._model_locks: dict[str, threading.Lock] = {}

    def pool(self, model: str) -> SlotPool:
        """The pool of ``model``, taken from the source on first use (and when its owner retired it).

        Raises:
            PoolClosedError: The client is closed.
            TritonCallError / LayoutError / SharedMemoryError: As creation fails.
        """
        pool = self.pools.get(model)
        if pool is not None and not pool.retired:
            return pool
        with self._lock:
            if self._is_closed():
                raise PoolClosedError("the client is closed")
            model_lock = self._model_locks.setdefault(model, threading.Lock())
        with model_lock:
            pool = self.pools.get(model)
            if pool is None or pool.retired:
                # A retired pool (the model was reloaded with another configuration): its owner
                # grants one of the new layout; the old one stays with the source until idle.
                if pool is not None:
                    logger.info("pool of %r retired by its owner; taking the new layout's", model)
                    self._signatures.pop(model, None)
                pool = self._source.get_pool(model, self._config.pool_for(model))
                self.pools[model] = pool
        return pool

    def layout_or_none(self, model: str) -> ModelLayout | None:
        """The model's slot layout, or ``None`` when it has none (the reason is logged once).

        Raises:
            PoolClosedError / TritonCallError / SharedMemoryError: As :meth:`pool`.
        """
        if model in self.no_layout:
            return None
        pool = self.pools.get(model)
        if pool is not None and not pool.retired:
            return pool.layout
        try:
            return self.pool(model).layout
        except LayoutError as e:
            with self._lock:
                first = model not in self.no_layout
                self.no_layout[model] = str(e)
            if first:
                logger.warning("model %r has no shared-memory slot layout; plain gRPC it is: %s", model, e)
            return None

    def signature(self, model: str) -> ModelSignature:
        """Every input and output of ``model`` as its configuration declares them (cached).

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
