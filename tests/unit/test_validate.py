from __future__ import annotations

import numpy as np
import pytest

from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.shm.validate import check_inputs
from ray_triton_shm.errors import InputError


def _multi_inputs(batch: int = 2, h: int = 16, w: int = 20) -> dict[str, np.ndarray]:
    return {
        "IMAGE": np.zeros((batch, 3, h, w), dtype=np.float32),
        "IDS": np.arange(batch * 10, dtype=np.int64).reshape(batch, 10),
    }


def test_valid_batched(multi_io_layout: ModelLayout) -> None:
    inputs = _multi_inputs(batch=3)
    checked = check_inputs(multi_io_layout, inputs)
    assert checked.batch == 3
    assert checked.nbytes == inputs["IMAGE"].nbytes + inputs["IDS"].nbytes
    assert list(checked.arrays) == ["IMAGE", "IDS"]
    assert checked.arrays["IMAGE"] is inputs["IMAGE"]


def test_input_order_follows_model(multi_io_layout: ModelLayout) -> None:
    inputs = _multi_inputs()
    reordered = {"IDS": inputs["IDS"], "IMAGE": inputs["IMAGE"]}
    assert list(check_inputs(multi_io_layout, reordered).arrays) == ["IMAGE", "IDS"]


def test_batch_above_slot_capacity_is_allowed(identity_layout: ModelLayout) -> None:
    # identity_layout holds 2 per slot; bigger batches are split later, not refused here.
    checked = check_inputs(identity_layout, {"INPUT0": np.ones((7, 4), np.float32)})
    assert checked.batch == 7


def test_valid_unbatched(unbatched_layout: ModelLayout) -> None:
    checked = check_inputs(unbatched_layout, {"A": np.zeros((2, 3), np.int32), "B": np.zeros(16, np.uint8)})
    assert checked.batch == 1
    assert checked.nbytes == 24 + 16


def test_unbatched_rejects_leading_batch_dim(unbatched_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="rank"):
        check_inputs(unbatched_layout, {"A": np.zeros((1, 2, 3), np.int32), "B": np.zeros(4, np.uint8)})


def test_unknown_name(identity_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="unknown: \\['INPUT1'\\]"):
        check_inputs(
            identity_layout,
            {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)},
        )


def test_missing_name(multi_io_layout: ModelLayout) -> None:
    inputs = _multi_inputs()
    del inputs["IDS"]
    with pytest.raises(InputError, match="missing: \\['IDS'\\]"):
        check_inputs(multi_io_layout, inputs)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.bool_])
def test_wrong_dtype_is_not_cast(identity_layout: ModelLayout, dtype: type) -> None:
    with pytest.raises(InputError, match="FP32") as info:
        check_inputs(identity_layout, {"INPUT0": np.ones((2, 4), dtype=dtype)})
    assert "no silent casts" in str(info.value)


def test_byte_swapped_dtype_is_refused(identity_layout: ModelLayout) -> None:
    with pytest.raises(InputError):
        check_inputs(identity_layout, {"INPUT0": np.ones((2, 4), dtype=">f4")})


@pytest.mark.parametrize("shape", [(4,), (2, 4, 1), (), (2, 2, 2)])
def test_wrong_rank(identity_layout: ModelLayout, shape: tuple) -> None:
    with pytest.raises(InputError, match="rank"):
        check_inputs(identity_layout, {"INPUT0": np.ones(shape, np.float32)})


@pytest.mark.parametrize("shape", [(2, 3), (2, 5), (1, 1)])
def test_wrong_fixed_dim(identity_layout: ModelLayout, shape: tuple) -> None:
    with pytest.raises(InputError, match="does not match model dims"):
        check_inputs(identity_layout, {"INPUT0": np.ones(shape, np.float32)})


def test_fixed_dim_inside_variable_tensor(multi_io_layout: ModelLayout) -> None:
    inputs = _multi_inputs()
    inputs["IMAGE"] = np.zeros((2, 4, 16, 16), np.float32)  # 4 channels, model says 3
    with pytest.raises(InputError, match="does not match"):
        check_inputs(multi_io_layout, inputs)


@pytest.mark.parametrize(("h", "w"), [(33, 48), (32, 49), (1000, 1)])
def test_variable_dim_too_big_for_slot(multi_io_layout: ModelLayout, h: int, w: int) -> None:
    with pytest.raises(InputError, match="too big for a slot"):
        check_inputs(multi_io_layout, _multi_inputs(h=h, w=w))


def test_variable_dim_at_maximum_fits(multi_io_layout: ModelLayout) -> None:
    assert check_inputs(multi_io_layout, _multi_inputs(h=32, w=48)).batch == 2


@pytest.mark.parametrize(
    "value",
    [
        np.array([["a", "b", "c", "d"]], dtype=object),
        np.array([["a", "b", "c", "d"]]),  # <U1
        np.array([[b"a", b"b", b"c", b"d"]]),  # |S1
        np.zeros((1, 4), dtype="V4"),
    ],
)
def test_object_and_string_arrays_refused(identity_layout: ModelLayout, value: np.ndarray) -> None:
    with pytest.raises(InputError, match="BYTES/string"):
        check_inputs(identity_layout, {"INPUT0": value})


def test_inconsistent_batch(multi_io_layout: ModelLayout) -> None:
    inputs = _multi_inputs(batch=2)
    inputs["IDS"] = np.zeros((3, 10), np.int64)
    with pytest.raises(InputError, match="different batch sizes: \\[2, 3\\]"):
        check_inputs(multi_io_layout, inputs)


def test_empty_batch(identity_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="empty"):
        check_inputs(identity_layout, {"INPUT0": np.ones((0, 4), np.float32)})


def test_empty_variable_dim(multi_io_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="empty"):
        check_inputs(multi_io_layout, _multi_inputs(h=0))


def test_empty_unbatched(unbatched_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="empty"):
        check_inputs(unbatched_layout, {"A": np.zeros((2, 3), np.int32), "B": np.zeros(0, np.uint8)})


def test_non_contiguous_arrays_accepted(identity_layout: ModelLayout, multi_io_layout: ModelLayout) -> None:
    wide = np.arange(24, dtype=np.float32).reshape(3, 8)
    strided = wide[:, ::2]
    assert not strided.flags.c_contiguous
    checked = check_inputs(identity_layout, {"INPUT0": strided})
    assert checked.batch == 3
    np.testing.assert_array_equal(checked.arrays["INPUT0"], strided)
    assert checked.nbytes == 3 * 4 * 4

    transposed = np.zeros((20, 16, 3, 2), np.float32).T  # shape (2, 3, 16, 20), Fortran order
    ids = np.asfortranarray(np.zeros((2, 10), np.int64))
    assert check_inputs(multi_io_layout, {"IMAGE": transposed, "IDS": ids}).batch == 2


def test_array_likes_are_converted(identity_layout: ModelLayout) -> None:
    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.ones((2, 4), np.float32)

    checked = check_inputs(identity_layout, {"INPUT0": ArrayLike()})
    assert isinstance(checked.arrays["INPUT0"], np.ndarray)
    assert checked.batch == 2


def test_plain_lists_refused(identity_layout: ModelLayout) -> None:
    with pytest.raises(InputError, match="numpy, cupy or DLPack array"):
        check_inputs(identity_layout, {"INPUT0": [[1.0, 2.0, 3.0, 4.0]]})


@pytest.mark.parametrize(
    "inputs",
    [
        [np.ones((1, 4), np.float32)],
        (("INPUT0", np.ones((1, 4), np.float32)),),
        np.ones((1, 4), np.float32),
        None,
    ],
)
def test_non_mapping_refused(identity_layout: ModelLayout, inputs: object) -> None:
    with pytest.raises(InputError, match="mapping"):
        check_inputs(identity_layout, inputs)  # type: ignore[arg-type]
