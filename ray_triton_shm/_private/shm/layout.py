"""Slot layouts derived from a model's configuration on the server.

A slot holds one batch of every input and output of one model; each tensor
gets a 64-byte aligned region sized for the largest batch and shape the slot
must accept, and whole slots are page aligned. A BYTES (STRING) tensor's
region holds its elements in Triton's serialised form, ``4 +
PoolConfig.max_element_bytes`` bytes per element.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.shm.bytes_tensor import PREFIX_BYTES
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import LayoutError

TENSOR_ALIGN = 64
SLOT_ALIGN = 4096

TRITON_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_TRITON = {v: k for k, v in TRITON_TO_NUMPY.items()}
_RAW = np.dtype(np.uint8)


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in a slot.

    Attributes:
        name: Tensor name.
        datatype: Triton datatype, e.g. ``FP32``.
        dims: Dims from the model config, without the batch dim; -1 is variable.
        max_dims: ``dims`` with every -1 replaced by its configured maximum.
        offset: Byte offset inside the slot.
        capacity: Bytes reserved (batch capacity x max shape x item size;
            for BYTES the item size is ``4 + element_bytes``).
        element_bytes: For BYTES tensors, the longest element the region is
            sized for (``PoolConfig.max_element_bytes``); 0 for other types.
    """

    name: str
    datatype: str
    dims: tuple[int, ...]
    max_dims: tuple[int, ...]
    offset: int
    capacity: int
    element_bytes: int = 0

    @property
    def is_bytes(self) -> bool:
        """Whether this is a BYTES (STRING) tensor, serialised in its region."""
        return self.datatype == "BYTES"

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the tensor's region: ``uint8`` (its raw serialised bytes) for BYTES."""
        return _RAW if self.is_bytes else TRITON_TO_NUMPY[self.datatype]

    @property
    def max_elements(self) -> int:
        """Elements the region holds at most (batch capacity x max shape)."""
        item = PREFIX_BYTES + self.element_bytes if self.is_bytes else self.dtype.itemsize
        return self.capacity // item


@dataclass(frozen=True)
class ModelLayout:
    """How one model's tensors are placed in a slot.

    Attributes:
        model: Model name.
        batched: Whether the model batches (``max_batch_size > 0``); if so
            every tensor has a leading batch dim not listed in ``dims``.
        batch_capacity: Largest batch a slot holds (1 when not batched).
        inputs / outputs: Tensor placements.
        slot_bytes: Size of one slot, page aligned.
        fingerprint: :func:`config_fingerprint` of the model configuration the
            layout was derived from ("" when unknown).
    """

    model: str
    batched: bool
    batch_capacity: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    slot_bytes: int
    fingerprint: str = ""

    def input(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)

    def output(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)

    @functools.cached_property
    def _inputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in reversed(self.inputs)}  # the first of a name, as a search finds

    @functools.cached_property
    def _outputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in reversed(self.outputs)}


def _tensor_entries(
    config: Mapping[str, Any], key: str, model: str, pool: PoolConfig
) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = []
    for tensor in config.get(key, []):
        name = tensor["name"]
        datatype = protocol_datatype(tensor["data_type"])
        if datatype == "BYTES" and pool.memory == "cuda":
            raise LayoutError(
                f"model {model!r} tensor {name!r} is BYTES/STRING: strings are not placed in "
                "GPU memory (PoolConfig.memory='cuda'); use system memory or plain gRPC"
            )
        if datatype not in TRITON_TO_NUMPY and datatype != "BYTES":
            raise LayoutError(f"model {model!r} tensor {name!r} has unsupported type {datatype}")
        dims = tuple(int(d) for d in tensor.get("dims", []))
        entries.append((name, datatype, dims))
    return entries


@dataclass(frozen=True)
class TensorSig:
    """A tensor as the model configuration declares it, whatever its type.

    Attributes:
        name: Tensor name.
        datatype: Triton datatype as the protocol spells it (``BYTES`` for ``TYPE_STRING``).
        dims: Dims without the batch dim, as clients send them; -1 is variable.
    """

    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ModelSignature:
    """Every input and output of a model, for calls that need no slot layout (plain gRPC).

    Attributes:
        model: Model name.
        batched: Whether tensors have a leading batch dim.
        inputs / outputs: The tensors.
    """

    model: str
    batched: bool
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]

    def input(self, name: str) -> TensorSig | None:
        return next((t for t in self.inputs if t.name == name), None)


def protocol_datatype(config_type: Any) -> str:
    """``TYPE_FP32`` -> ``FP32``; ``TYPE_STRING`` -> ``BYTES`` (its name on the wire)."""
    datatype = str(config_type).removeprefix("TYPE_")
    return "BYTES" if datatype == "STRING" else datatype


def signature_from_config(config: Mapping[str, Any]) -> ModelSignature:
    """Read a model's tensors from its configuration; refuses nothing Triton serves.

    Args:
        config: The model configuration as JSON (``get_model_config(as_json=True)``).

    Returns:
        The signature.
    """

    def tensors(key: str) -> tuple[TensorSig, ...]:
        return tuple(
            TensorSig(
                str(t["name"]),
                protocol_datatype(t.get("data_type", "TYPE_INVALID")),
                tuple(int(d) for d in t.get("dims", [])),
            )
            for t in config.get(key, [])
        )

    return ModelSignature(
        model=str(config.get("name", "?")),
        batched=int(config.get("max_batch_size", 0)) > 0,
        inputs=tensors("input"),
        outputs=tensors("output"),
    )


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A short hash of what a slot layout depends on in a model configuration.

    Name, batch size, and every input's and output's name, type, dims and
    reshape; a config that differs in any of these gets another fingerprint.
    """

    def tensors(key: str) -> list[list[Any]]:
        return [
            [
                str(t.get("name")),
                protocol_datatype(t.get("data_type", "")),
                [int(d) for d in t.get("dims", [])],
                [int(d) for d in (t.get("reshape") or {}).get("shape", [])],
            ]
            for t in config.get(key, [])
        ]

    essence = [
        str(config.get("name", "")),
        int(config.get("max_batch_size", 0)),
        tensors("input"),
        tensors("output"),
    ]
    return hashlib.sha256(json.dumps(essence).encode()).hexdigest()[:16]


def layout_from_config(config: Mapping[str, Any], pool: PoolConfig) -> ModelLayout:
    """Lay out a model from its Triton configuration (``get_model_config(as_json=True)``).

    Args:
        config: The model configuration as JSON (dims may be strings).
        pool: Pool settings: batch cap and maxima for variable dims.

    Returns:
        The layout.

    Raises:
        LayoutError: BYTES tensors in a CUDA pool, a variable dim without a
            maximum, a maximum that does not fit the dims, or a batch cap above
            the model's.
    """
    model = str(config.get("name", "?"))
    model_max_batch = int(config.get("max_batch_size", 0))
    batched = model_max_batch > 0
    if pool.max_batch_size is not None and batched and pool.max_batch_size > model_max_batch:
        raise LayoutError(
            f"PoolConfig.max_batch_size={pool.max_batch_size} exceeds model {model!r}'s "
            f"max_batch_size={model_max_batch}"
        )
    capacity = (pool.max_batch_size or model_max_batch) if batched else 1
    known = set()
    offset = 0

    def place(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
        nonlocal offset
        specs = []
        for name, datatype, dims in entries:
            known.add(name)
            max_dims = _max_dims(model, name, dims, pool.max_shapes.get(name))
            element = pool.max_element_bytes if datatype == "BYTES" else 0
            item = PREFIX_BYTES + element if element else TRITON_TO_NUMPY[datatype].itemsize
            nbytes = capacity * math.prod(max_dims) * item
            offset = _align(offset, TENSOR_ALIGN)
            specs.append(TensorSpec(name, datatype, dims, max_dims, offset, nbytes, element))
            offset += nbytes
        return tuple(specs)

    inputs = place(_tensor_entries(config, "input", model, pool))
    outputs = place(_tensor_entries(config, "output", model, pool))
    if not inputs or not outputs:
        raise LayoutError(f"model {model!r} declares no inputs or no outputs")
    unknown = set(pool.max_shapes) - known
    if unknown:
        raise LayoutError(f"PoolConfig.max_shapes names unknown tensors of {model!r}: {sorted(unknown)}")
    return ModelLayout(
        model=model,
        batched=batched,
        batch_capacity=capacity,
        inputs=inputs,
        outputs=outputs,
        slot_bytes=_align(max(offset, 1), SLOT_ALIGN),
        fingerprint=config_fingerprint(config),
    )


def _max_dims(model: str, name: str, dims: tuple[int, ...], given: tuple[int, ...] | None) -> tuple[int, ...]:
    if given is None:
        if any(d < 0 for d in dims):
            raise LayoutError(
                f"model {model!r} tensor {name!r} has variable dims {list(dims)}; give its "
                f"largest shape with PoolConfig(max_shapes={{{name!r}: (...)}})"
            )
        return dims
    if len(given) != len(dims):
        raise LayoutError(
            f"max_shapes[{name!r}]={list(given)} has rank {len(given)}, model {model!r} "
            f"expects rank {len(dims)} ({list(dims)})"
        )
    for d, g in zip(dims, given):
        if d >= 0 and d != g:
            raise LayoutError(f"max_shapes[{name!r}]={list(given)} conflicts with fixed dims {list(dims)}")
    return tuple(given)
