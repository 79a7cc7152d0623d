from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from ray_triton_shm._private.shm.layout import (
    SLOT_ALIGN,
    TENSOR_ALIGN,
    ModelLayout,
    TensorSig,
    layout_from_config,
    signature_from_config,
)
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import LayoutError


def _all_specs(layout: ModelLayout) -> list:
    return [*layout.inputs, *layout.outputs]


def _assert_well_formed(layout: ModelLayout) -> None:
    specs = sorted(_all_specs(layout), key=lambda s: s.offset)
    for spec in specs:
        assert spec.offset % TENSOR_ALIGN == 0, spec
        assert spec.capacity == layout.batch_capacity * math.prod(spec.max_dims) * spec.dtype.itemsize
    for a, b in itertools.pairwise(specs):
        assert a.offset + a.capacity <= b.offset, (a, b)
    assert specs[-1].offset + specs[-1].capacity <= layout.slot_bytes
    assert layout.slot_bytes % SLOT_ALIGN == 0
    assert layout.slot_bytes > 0


def test_batched_model(identity_config: dict[str, Any]) -> None:
    layout = layout_from_config(identity_config, PoolConfig())
    assert layout.model == "identity"
    assert layout.batched is True
    assert layout.batch_capacity == 8
    (inp,) = layout.inputs
    (out,) = layout.outputs
    assert (inp.name, inp.datatype, inp.dims, inp.max_dims) == ("INPUT0", "FP32", (4,), (4,))
    assert inp.dtype == np.dtype(np.float32)
    assert inp.offset == 0
    assert inp.capacity == 8 * 4 * 4
    assert out.offset == 128  # right after the input, already 64-aligned
    assert layout.slot_bytes == 4096
    assert layout.input("INPUT0") is inp and layout.output("OUTPUT0") is out
    assert layout.input("OUTPUT0") is None and layout.output("nope") is None
    _assert_well_formed(layout)


def test_pool_may_lower_batch(identity_config: dict[str, Any]) -> None:
    layout = layout_from_config(identity_config, PoolConfig(max_batch_size=2))
    assert layout.batch_capacity == 2
    assert layout.inputs[0].capacity == 2 * 4 * 4
    _assert_well_formed(layout)


def test_pool_may_not_raise_batch(identity_config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError, match="max_batch_size"):
        layout_from_config(identity_config, PoolConfig(max_batch_size=9))


def test_max_batch_size_as_string(identity_config: dict[str, Any]) -> None:
    identity_config["max_batch_size"] = "8"
    assert layout_from_config(identity_config, PoolConfig()).batch_capacity == 8


def test_unbatched_model(unbatched_config: dict[str, Any]) -> None:
    layout = layout_from_config(unbatched_config, PoolConfig(max_shapes={"B": (100,)}))
    assert layout.batched is False
    assert layout.batch_capacity == 1
    a, b = layout.inputs
    assert a.capacity == 2 * 3 * 4
    assert b.dims == (-1,) and b.max_dims == (100,) and b.capacity == 100
    _assert_well_formed(layout)


def test_unbatched_model_ignores_pool_batch(unbatched_config: dict[str, Any]) -> None:
    layout = layout_from_config(unbatched_config, PoolConfig(max_batch_size=4, max_shapes={"B": (8,)}))
    assert layout.batch_capacity == 1


def test_unbatched_missing_batch_key(unbatched_config: dict[str, Any]) -> None:
    del unbatched_config["max_batch_size"]
    layout = layout_from_config(unbatched_config, PoolConfig(max_shapes={"B": (8,)}))
    assert layout.batched is False


def test_variable_dims(multi_io_config: dict[str, Any], multi_io_shapes: dict) -> None:
    layout = layout_from_config(multi_io_config, PoolConfig(max_shapes=multi_io_shapes))
    image = layout.input("IMAGE")
    scores = layout.output("SCORES")
    mask = layout.output("MASK")
    assert image.dims == (3, -1, -1) and image.max_dims == (3, 32, 48)
    assert image.capacity == 4 * 3 * 32 * 48 * 4
    assert layout.input("IDS").dtype == np.dtype(np.int64)
    assert scores.max_dims == (100,) and scores.dtype == np.dtype(np.float16)
    assert scores.capacity == 4 * 100 * 2
    assert mask.dtype == np.dtype(np.bool_) and mask.capacity == 4 * 4
    _assert_well_formed(layout)


def test_odd_sizes_are_aligned(unbatched_config: dict[str, Any]) -> None:
    # 7 bytes of UINT8 between two INT32 tensors: the next offset must still be 64-aligned.
    unbatched_config["input"] = [
        {"name": "B", "data_type": "TYPE_UINT8", "dims": ["-1"]},
        {"name": "C", "data_type": "TYPE_FP64", "dims": ["3"]},
    ]
    layout = layout_from_config(unbatched_config, PoolConfig(max_shapes={"B": (7,)}))
    b, c = layout.inputs
    assert (b.offset, b.capacity) == (0, 7)
    assert c.offset == 64
    assert layout.outputs[0].offset == 128
    _assert_well_formed(layout)


def test_large_slot_is_page_aligned(identity_config: dict[str, Any]) -> None:
    layout = layout_from_config(
        identity_config | {"input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["-1"]}]},
        PoolConfig(max_shapes={"INPUT0": (1001,)}),
    )
    _assert_well_formed(layout)
    assert layout.slot_bytes >= 8 * 1001 * 4 + 128
    assert layout.slot_bytes - (layout.outputs[-1].offset + layout.outputs[-1].capacity) < SLOT_ALIGN


def test_variable_dim_needs_max_shape(multi_io_config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError, match=r"IMAGE.*max_shapes"):
        layout_from_config(multi_io_config, PoolConfig(max_shapes={"SCORES": (10,)}))
    with pytest.raises(LayoutError, match="SCORES"):
        layout_from_config(multi_io_config, PoolConfig(max_shapes={"IMAGE": (3, 8, 8)}))


@pytest.mark.parametrize("given", [(32, 48), (3, 32, 48, 1), ()])
def test_max_shape_rank_mismatch(multi_io_config: dict[str, Any], given: tuple) -> None:
    with pytest.raises(LayoutError, match="rank"):
        layout_from_config(multi_io_config, PoolConfig(max_shapes={"IMAGE": given, "SCORES": (10,)}))


def test_max_shape_conflicts_with_fixed_dim(multi_io_config: dict[str, Any]) -> None:
    with pytest.raises(LayoutError, match="conflicts"):
        layout_from_config(multi_io_config, PoolConfig(max_shapes={"IMAGE": (4, 32, 32), "SCORES": (10,)}))


def test_max_shape_for_fixed_tensor_must_match(identity_config: dict[str, Any]) -> None:
    assert layout_from_config(identity_config, PoolConfig(max_shapes={"INPUT0": (4,)})).inputs[
        0
    ].max_dims == (4,)
    with pytest.raises(LayoutError):
        layout_from_config(identity_config, PoolConfig(max_shapes={"INPUT0": (5,)}))


def test_unknown_max_shape_names(multi_io_config: dict[str, Any], multi_io_shapes: dict) -> None:
    shapes = {**multi_io_shapes, "IMAGES": (3, 1, 1)}
    with pytest.raises(LayoutError, match="IMAGES"):
        layout_from_config(multi_io_config, PoolConfig(max_shapes=shapes))


@pytest.mark.parametrize("key", ["input", "output"])
def test_string_tensor_refused_in_cuda_pools(identity_config: dict[str, Any], key: str) -> None:
    identity_config[key][0]["data_type"] = "TYPE_STRING"
    with pytest.raises(LayoutError, match="BYTES/STRING"):
        layout_from_config(identity_config, PoolConfig(memory="cuda"))


def test_unsupported_type_refused(identity_config: dict[str, Any]) -> None:
    identity_config["input"][0]["data_type"] = "TYPE_BF16"
    with pytest.raises(LayoutError, match="BF16"):
        layout_from_config(identity_config, PoolConfig())


def test_reshape_lays_out_the_dims_clients_send(identity_config: dict[str, Any]) -> None:
    # `dims` is the shape on the wire (and in the slot); `reshape` is what the model sees.
    identity_config["input"][0]["dims"] = ["4"]
    identity_config["input"][0]["reshape"] = {"shape": ["2", "2"]}
    identity_config["output"][0]["dims"] = ["4"]
    layout = layout_from_config(identity_config, PoolConfig(max_batch_size=2))
    assert layout.input("INPUT0").max_dims == (4,)
    assert layout.input("INPUT0").capacity == 2 * 4 * 4


def test_signature_reads_every_model(identity_config: dict[str, Any]) -> None:
    identity_config["input"][0]["data_type"] = "TYPE_STRING"
    identity_config["input"][0]["reshape"] = {"shape": []}
    signature = signature_from_config(identity_config)
    assert signature.batched
    assert signature.input("INPUT0") == TensorSig("INPUT0", "BYTES", (4,))
    assert [t.datatype for t in signature.outputs] == ["FP32"]
    assert signature.input("nope") is None


@pytest.mark.parametrize("key", ["input", "output"])
def test_model_without_inputs_or_outputs_refused(identity_config: dict[str, Any], key: str) -> None:
    del identity_config[key]
    with pytest.raises(LayoutError, match="no inputs or no outputs"):
        layout_from_config(identity_config, PoolConfig())


@pytest.mark.parametrize(
    ("triton", "numpy_dtype"),
    [
        ("TYPE_BOOL", np.bool_),
        ("TYPE_UINT8", np.uint8),
        ("TYPE_UINT16", np.uint16),
        ("TYPE_UINT32", np.uint32),
        ("TYPE_UINT64", np.uint64),
        ("TYPE_INT8", np.int8),
        ("TYPE_INT16", np.int16),
        ("TYPE_INT32", np.int32),
        ("TYPE_INT64", np.int64),
        ("TYPE_FP16", np.float16),
        ("TYPE_FP32", np.float32),
        ("TYPE_FP64", np.float64),
        ("FP32", np.float32),  # without the prefix, as in the HTTP/KServe metadata
    ],
)
def test_datatypes(identity_config: dict[str, Any], triton: str, numpy_dtype: type) -> None:
    identity_config["input"][0]["data_type"] = triton
    spec = layout_from_config(identity_config, PoolConfig()).inputs[0]
    assert spec.dtype == np.dtype(numpy_dtype)
    assert spec.datatype == triton.removeprefix("TYPE_")
    assert spec.capacity == 8 * 4 * np.dtype(numpy_dtype).itemsize
