"""BYTES (STRING) tensors in slots: serialisation, parsing, layout sizes, validation, leases."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ray_triton_shm._private.shm.bytes_tensor import parse, serialize_into, serialized_size
from ray_triton_shm._private.shm.layout import TENSOR_ALIGN, ModelLayout, layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.validate import bytes_overflow, check_inputs
from ray_triton_shm.config import PoolConfig
from ray_triton_shm.errors import ConfigError, InputError, LayoutError, TritonCallError

# The `strings` example model as Triton returns its config.
STRINGS_CONFIG: dict[str, Any] = {
    "name": "strings",
    "backend": "python",
    "max_batch_size": 8,
    "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["-1"]}],
    "output": [
        {"name": "UPPER", "data_type": "TYPE_STRING", "dims": ["-1"]},
        {"name": "LENGTH", "data_type": "TYPE_INT32", "dims": ["-1"]},
    ],
}
SHAPES = {"TEXT": (3,), "UPPER": (3,), "LENGTH": (3,)}


def _layout(bound: int = 16, batch: int = 2) -> ModelLayout:
    config = PoolConfig(max_batch_size=batch, max_shapes=SHAPES, max_element_bytes=bound)
    return layout_from_config(copy.deepcopy(STRINGS_CONFIG), config)


def _triton_form(items: list[bytes]) -> bytes:
    """Triton's serialised BYTES form, written out independently of the code under test."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def test_serialize_into_writes_tritons_form() -> None:
    items = np.array([[b"hello", "wörld".encode(), b""], [b"a\x00b", b"x" * 7, b"z"]], dtype=object)
    region = np.full(256, 0xAB, np.uint8)
    size = serialize_into(region, items)
    expected = _triton_form(list(items.flat))
    assert size == len(expected) == sum(4 + len(i) for i in items.flat)
    assert region[:size].tobytes() == expected
    assert (region[size:] == 0xAB).all()  # nothing past the serialised size is touched


def test_serialize_into_refuses_what_does_not_fit_and_encodes_str() -> None:
    with pytest.raises(InputError, match="do not fit"):
        serialize_into(np.zeros(8, np.uint8), np.array([b"12345"], dtype=object))
    with pytest.raises(InputError, match="bytes or str"):
        serialize_into(np.zeros(8, np.uint8), np.array([3], dtype=object))
    region = np.zeros(16, np.uint8)
    assert serialize_into(region, np.array(["é"])) == 6
    assert region[:6].tobytes() == _triton_form(["é".encode()])


def test_parse_reads_tritons_form_and_copies() -> None:
    items = [b"", b"abc", "ü".encode(), b"\x00" * 5]
    region = np.frombuffer(bytearray(_triton_form(items) + b"garbage after"), np.uint8)
    out = parse(region, len(items))
    assert out.dtype == object and out.tolist() == items
    region.setflags(write=True)
    region[:] = 0  # the parsed elements are copies, not views of the region
    assert out.tolist() == items
    serialised = _triton_form(items)
    assert serialized_size(np.frombuffer(serialised, np.uint8), len(items)) == len(serialised)


@pytest.mark.parametrize(
    "data",
    [b"\x05\x00\x00\x00abc", b"\x01\x00"],  # an element past the end; a length cut short
)
def test_parse_refuses_lengths_past_the_region(data: bytes) -> None:
    with pytest.raises(TritonCallError, match="BYTES output"):
        parse(np.frombuffer(data, np.uint8), 1, "strings")


def test_bytes_regions_are_sized_by_the_bound() -> None:
    layout = _layout(bound=16, batch=2)
    text, upper, length = layout.input("TEXT"), layout.output("UPPER"), layout.output("LENGTH")
    assert text.is_bytes and upper.is_bytes and not length.is_bytes
    assert text.capacity == upper.capacity == 2 * 3 * (4 + 16)
    assert text.element_bytes == 16 and length.element_bytes == 0
    assert text.max_elements == 6 and length.capacity == 2 * 3 * 4
    assert text.dtype == np.uint8  # the region is raw serialised bytes
    specs = sorted([text, upper, length], key=lambda s: s.offset)
    for a, b in itertools.pairwise(specs):
        assert a.offset + a.capacity <= b.offset and b.offset % TENSOR_ALIGN == 0
    bigger = _layout(bound=300, batch=2)
    assert bigger.input("TEXT").capacity == 2 * 3 * 304
    # Another bound is another layout: a node's pool of one bound is never used as one of another.
    assert bigger != layout and bigger.fingerprint == layout.fingerprint


def test_default_bound_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_TRITON_SHM_MAX_ELEMENT_BYTES", raising=False)
    assert PoolConfig().max_element_bytes == 256
    monkeypatch.setenv("RAY_TRITON_SHM_MAX_ELEMENT_BYTES", "1000")
    assert PoolConfig().max_element_bytes == 1000
    assert PoolConfig(max_element_bytes=8).max_element_bytes == 8  # explicit beats the environment
    monkeypatch.setenv("RAY_TRITON_SHM_MAX_ELEMENT_BYTES", "lots")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_MAX_ELEMENT_BYTES"):
        PoolConfig()


@pytest.mark.parametrize("bad", [0, -1, 1 << 32, True, 2.5])
def test_bound_is_validated(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_element_bytes"):
        PoolConfig(max_element_bytes=bad)


def test_cuda_pools_refuse_bytes() -> None:
    with pytest.raises(LayoutError, match="BYTES/STRING"):
        layout_from_config(STRINGS_CONFIG, PoolConfig(max_shapes=SHAPES, memory="cuda"))


@pytest.mark.parametrize(
    "text",
    [
        np.array([["a", "bé"]], dtype=object),
        np.array([["a", "bé"]]),  # <U2
        np.array([[b"a", "bé".encode()]]),  # |S3
    ],
)
def test_check_inputs_takes_bytes_and_str(text: np.ndarray) -> None:
    checked = check_inputs(_layout(), {"TEXT": text})
    value = checked.arrays["TEXT"]
    assert value.dtype == object and value.tolist() == [[b"a", "bé".encode()]]
    assert checked.nbytes == (4 + 1) + (4 + 3) and checked.batch == 1


def test_check_inputs_refuses_non_strings_and_too_many_elements() -> None:
    with pytest.raises(InputError, match="bytes or str"):
        check_inputs(_layout(), {"TEXT": np.array([[1.0]], np.float32)})
    with pytest.raises(InputError, match="too big for a slot"):
        check_inputs(_layout(), {"TEXT": np.array([["a"] * 4])})


def test_bytes_overflow_is_per_element_and_inclusive() -> None:
    layout = _layout(bound=4)
    at_bound = check_inputs(layout, {"TEXT": np.array([[b"1234", b""]], dtype=object)})
    assert bytes_overflow(layout, at_bound) is None
    over = check_inputs(layout, {"TEXT": np.array([[b"12345", b""]], dtype=object)})
    reason = bytes_overflow(layout, over)
    assert reason is not None and "5 bytes" in reason and "max_element_bytes" in reason


def test_lease_round_trip_through_a_slot(make_pool: Callable[..., SlotPool]) -> None:
    layout = _layout(bound=8)
    pool = make_pool(layout, 1)
    text = np.array([["ab", "", "ü"], ["x" * 8, "y", "z"]], dtype=object)
    checked = check_inputs(layout, {"TEXT": text})
    with pool.acquire(1.0) as lease:
        assert lease.write_input("TEXT", checked.arrays["TEXT"]) == (2, 3)
        size = lease.input_nbytes["TEXT"]
        assert lease.input_shapes == {"TEXT": (2, 3)}  # what client.run(lease) sends
        expected = _triton_form(list(checked.arrays["TEXT"].flat))
        assert size == len(expected)
        assert lease.slot.arrays["TEXT"][:size].tobytes() == expected
        # Triton would write UPPER in the same form: put it there, read it back as the client does.
        serialize_into(lease.slot.arrays["UPPER"], checked.arrays["TEXT"])
        out = lease.output("UPPER", (2, 3))
        assert out.shape == (2, 3) and out.tolist() == checked.arrays["TEXT"].tolist()
        assert lease.copy_output("UPPER", (2, 3)).tolist() == out.tolist()
        with pytest.raises(InputError, match="BYTES"):
            lease.input("TEXT", (1, 3))
    assert lease.input_nbytes == {}
    assert pool.stats().free == 1 and pool.stats().pinned == 0  # parsed outputs pin nothing
