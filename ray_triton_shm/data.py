"""Ray Data batch inference through the Triton of each worker's node.

Example:
    >>> import ray
    >>> from ray_triton_shm.data import TritonPredictor
    >>> ds = ray.data.from_items([{"INPUT0": x} for x in images])          # doctest: +SKIP
    >>> out = ds.map_batches(
    ...     TritonPredictor,
    ...     fn_constructor_kwargs={"model": "multi_io", "model_repository": "examples"},
    ...     compute=ray.data.ActorPoolStrategy(size=2),
    ...     batch_size=64,
    ... )                                                                   # doctest: +SKIP

Works with the ``numpy`` (dict of arrays) and ``pandas`` batch formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.cuda import is_device_array, to_host
from ray_triton_shm.errors import InputError
from ray_triton_shm.node import NodeClient, NodeConfig

__all__ = ["TritonPredictor"]


def _column_array(values: Any) -> Any:
    if is_device_array(values):  # a cupy/torch CUDA column stays on the GPU
        return values
    array = np.asarray(values)
    if array.dtype == object:  # pandas keeps per-row arrays as objects
        array = np.stack(list(values))
    return array


class TritonPredictor:
    """A callable class for ``Dataset.map_batches`` that runs a Triton model via shm.

    Args:
        model: Model name.
        input_columns: Model input name -> column name (default: same names).
        output_columns: Model output name -> column name (default: same names).
        node_config: Creates the node actor if this node has none yet.
        model_repository / pools: Shortcut for ``node_config`` (see
            :meth:`NodeConfig.from_args`).
        slots_per_model: At most this many slots used by this worker at once
            (``None``: no cap; slots are shared with every process on the node).
        grpc: Send tensors over plain gRPC instead (for comparison).
        memory: Slot memory, ``"system"``, ``"cuda"`` or ``"auto"`` (see
            :class:`~ray_triton_shm.node.NodeClient`). GPU outputs are copied to
            host before they go back into the dataset, since Ray Data blocks
            live in host memory (the object store); with ``"cuda"`` only the
            tensors' trip to and from Triton stays on the GPU.
    """

    def __init__(
        self,
        model: str,
        *,
        input_columns: Mapping[str, str] | None = None,
        output_columns: Mapping[str, str] | None = None,
        node_config: NodeConfig | None = None,
        model_repository: str | None = None,
        pools: Mapping[str, Mapping[str, Any]] | None = None,
        slots_per_model: int | None = None,
        grpc: bool = False,
        memory: str = "system",
    ) -> None:
        if node_config is None and model_repository is not None:
            node_config = NodeConfig.from_args(model_repository, pools=pools)
        self.model = model
        self._client = NodeClient(
            node_config, slots_per_model=slots_per_model, memory=memory, kind="data", grpc_fallback=True
        )
        signature = self._client.client.signature(model)  # any model: BYTES ones go over gRPC
        self._inputs = dict(input_columns or {s.name: s.name for s in signature.inputs})
        self._outputs = dict(output_columns or {s.name: s.name for s in signature.outputs})
        self._grpc = grpc

    def __call__(self, batch: Any) -> Any:
        """Run one batch; returns it with the output columns added.

        Raises:
            InputError: A column is missing or has the wrong dtype/shape.
        """
        is_frame = hasattr(batch, "columns") and hasattr(batch, "assign")
        columns = list(batch.columns) if is_frame else list(batch)
        missing = [c for c in self._inputs.values() if c not in columns]
        if missing:
            raise InputError(f"batch lacks columns {missing} for model {self.model!r}")
        inputs = {name: _column_array(batch[column]) for name, column in self._inputs.items()}
        call = self._client.infer_grpc if self._grpc else self._client.infer
        result = {name: to_host(value) for name, value in call(self.model, inputs).items()}
        # Ray Data kills its workers without a close when the job ends: report per batch.
        self._client.flush_reports()
        if is_frame:
            frame = batch.copy()
            for name, column in self._outputs.items():
                frame[column] = list(result[name]) if result[name].ndim > 1 else result[name]
            return frame
        out = dict(batch)
        for name, column in self._outputs.items():
            out[column] = result[name]
        return out
