"""The C reader and writer of JSON tensors: built, and exactly the json module's numbers and text."""

from __future__ import annotations

import json
import random
import struct
import tracemalloc
from decimal import Decimal, localcontext

import numpy as np
import pytest

from ray_triton_shm._private.serve.protocol import kserve, kserve_json
from tests.helpers import assert_built_from_current_source


def test_the_c_reader_and_writer_are_built() -> None:
    assert kserve_json.available(), (
        "the _kserve_json extension was not built (pip install -e . with a C compiler)"
    )
    assert_built_from_current_source(kserve_json._kserve_json)


def _read_as_doubles(texts: list[str]) -> np.ndarray:
    doc = kserve_json.loads_numbers(('{"data": [' + ", ".join(texts) + "]}").encode())
    assert doc is not None and isinstance(doc["data"], kserve_json.JsonNumbers)
    assert doc["data"].kind == "d"
    return np.frombuffer(doc["data"].buffer, np.float64)


def _random_number_texts(rng: random.Random, count: int) -> list[str]:
    texts = []
    for _ in range(count):
        bits = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if np.isfinite(bits):
            texts.append(repr(bits))  # shortest digits, any magnitude
        texts.append(repr(float(np.float32(rng.uniform(-1, 1) * 10.0 ** rng.randint(-12, 30)))))
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 21))).lstrip("0") or "0"
        cut = rng.randint(1, len(digits))
        text = digits[:cut] + "." + (digits[cut:] or "0")
        if rng.random() < 0.5:
            text += rng.choice("eE") + rng.choice(["", "+", "-"]) + str(rng.randint(0, 40))
        texts.append(("-" if rng.random() < 0.3 else "") + text)
        # The digits of a point half-way between two doubles, cut at 17 to 19 digits: the hardest roundings.
        low = rng.uniform(1e-15, 1e20)
        middle = (Decimal(low) + Decimal(float(np.nextafter(low, np.inf)))) / 2
        texts.append(format(middle, f".{rng.randint(16, 18)}e"))
    return texts


def test_numbers_are_read_as_float_reads_them() -> None:
    rng = random.Random(7)
    with localcontext() as context:
        context.prec = 60
        texts = _random_number_texts(rng, 25_000)
    texts += ["0.0", "-0.0", "0.1", "1e-320", "2.2250738585072014e-308", "1.7976931348623157e308"]
    texts += ["9007199254740993.0", "9007199254740995.0", "0.30000000000000004", "5e-324", "123456789e-27"]
    got = _read_as_doubles(texts)
    want = np.array([float(t) for t in texts])
    wrong = np.nonzero(got.view(np.uint64) != want.view(np.uint64))[0]
    assert not wrong.size, [(texts[i], got[i], want[i]) for i in wrong[:5]]


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    specials = [0.1, 1e-4, 1e-5, 1e15, 1e16, 1.5e16, 1e22, 1e23, 5e-324, 1.7976931348623157e308, -0.0, 0.0]
    specials += [float("nan"), float("inf"), float("-inf"), 2 / 3, 1e-10, 1e42, 0.30000000000000004]
    specials += [10.0**k for k in range(-20, 50)] + [9.5 * 10.0**k for k in range(-20, 50)]
    arrays = [
        np.frombuffer(rng.integers(0, 2**64, 50_000, dtype=np.uint64).tobytes(), np.float64),
        np.frombuffer(rng.integers(0, 2**32, 50_000, dtype=np.uint32).tobytes(), np.float32),
        rng.random(50_000).astype(np.float32),
        rng.standard_normal(50_000) * 10.0 ** rng.integers(-12, 45, 50_000),
        np.array([float(f"{v:.{d}f}") for v, d in zip(rng.random(20_000) * 1e6, rng.integers(0, 6, 20_000))]),
        np.array(specials),
        np.array([True, False, True]),
        np.array([], dtype=np.float32),
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        np.arange(5, dtype=">f4"),
    ]
    with np.errstate(over="ignore"):
        arrays.append(np.array(specials, dtype=np.float32))
        arrays.append(np.array(specials, dtype=np.float16))
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        info = np.iinfo(dtype)
        arrays.append(np.array([info.min, info.max, 0, 1], dtype=dtype))
        arrays.append(rng.integers(info.min, info.max, 5_000, dtype=dtype, endpoint=True))
    return arrays


@pytest.mark.parametrize("index", range(len(_arrays())))
def test_numbers_are_written_as_the_json_module_writes_them(index: int) -> None:
    array = _arrays()[index]
    assert kserve_json.numbers_json(array) == json.dumps(array.ravel().tolist()).encode()


def test_json_answers_are_the_json_modules_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    request = kserve.DecodedRequest({}, None, {"BIN": True}, False, 'r"1')
    outputs = {f"OUT{i}": array for i, array in enumerate(_arrays()) if array.dtype.isnative}
    outputs["BIN"] = np.arange(4, dtype=np.int32)
    outputs["TEXT"] = np.array([b"a", b"\xc3\xa9"], dtype=object)
    fast = kserve.encode_response("model", request, outputs, "2")
    monkeypatch.setattr(kserve_json, "_kserve_json", None)
    assert kserve.encode_response("model", request, outputs, "2") == fast


def test_what_the_c_reader_cannot_read_exactly_is_left_to_the_json_module() -> None:
    for text in [
        b'{"a": "\\u0041"}',  # escapes
        b'{"a": 1, "a": 2}',  # a key given twice: the json module's refusal
        b'{"data": [NaN]}',
        b'{"data": [1e400]}',
        b'{"data": [12345678901234567890]}',  # past int64
        b'{"a": 12345678901234567890}',
        b"\xef\xbb\xbf{}",  # a byte-order mark
        b'{"a": "\xff"}',  # not UTF-8
        b'{"a": "\x01"}',  # a control character
        b"[" * 300 + b"]" * 300,
        b'{"a": 1} x',
        b"",
    ]:
        assert kserve_json.loads_numbers(text) is None, text
    doc = kserve_json.loads_numbers(b'{"data": [1, 2.5], "shape": [1, 2], "other": {"data": [true]}}')
    assert isinstance(doc["data"], kserve_json.JsonNumbers) and doc["data"].kind == "d"
    assert doc["shape"] == [1, 2] and doc["other"] == {"data": [True]}


def _peak_bytes(data: bytes) -> int:
    tracemalloc.start()
    try:
        decoded = kserve.decode_request(data, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded.inputs["F"].shape == (1, 200_000)
    return peak


def test_a_json_tensor_is_read_without_a_python_object_per_number(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.random.default_rng(5).random(200_000).astype(np.float32)
    data = json.dumps(
        {"inputs": [{"name": "F", "datatype": "FP32", "shape": [1, 200_000], "data": values.tolist()}]}
    ).encode()
    fast = _peak_bytes(data)
    monkeypatch.setattr(kserve_json, "_kserve_json", None)
    slow = _peak_bytes(data)
    # The json module holds a float and a list slot per number (32 bytes); the C reader 8 bytes.
    assert fast < 16 * values.size < slow, (fast, slow)


def test_memory_follows_the_numbers_read_not_the_commas_announced() -> None:
    """A run of commas after one number announces ten million elements: nothing is sized by it."""
    text = b'{"data": [1' + b"," * 10_000_000 + b"]}"
    tracemalloc.start()
    try:
        assert kserve_json.loads_numbers(text) is None  # malformed: the json module's refusal
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


_FUZZ_SEEDS = [
    b'{"inputs": [{"name": "I", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}], "id": "x"}',
    b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [3], "data": [0.5, -1e-3, 2E+5]}],'
    b' "outputs": [{"name": "O", "parameters": {"binary_data": true}}]}',
    b'{"data": [1, 2.5, -0, 3e2], "a": null, "b": [true, false, {"c": "d"}]}',
    b'[{"data": [[1, 2], [3]]}, "s", 12, -0.0, {}]',
]
_FUZZ_BYTES = b'{}[]",:0123456789-+.eE tnfrualsNI\\\x00\x01\xff\xc3\xa9'


def _as_read(value: object) -> object:
    """The C reader's document with its :class:`JsonNumbers` as (kind, bytes)."""
    if isinstance(value, kserve_json.JsonNumbers):
        return (value.kind, bytes(value.buffer))
    if isinstance(value, dict):
        return {key: _as_read(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_read(item) for item in value]
    return value


def _as_json_read(value: object, data: bool = False) -> object:
    """The json module's document as the C reader gives it: a flat ``data`` array of numbers as
    (kind, bytes)."""
    if data and isinstance(value, list) and value and all(type(v) in (int, float) for v in value):
        if all(type(v) is int for v in value):
            return ("q", np.array(value, np.int64).tobytes())
        return ("d", np.array([float(v) for v in value], np.float64).tobytes())
    if isinstance(value, dict):
        return {key: _as_json_read(item, key == "data") for key, item in value.items()}
    if isinstance(value, list):
        return [_as_json_read(item) for item in value]
    return value


def test_what_the_c_reader_reads_is_what_the_json_module_reads() -> None:
    """Mutated requests: whatever the C reader takes, the json module reads alike; it takes no text
    the json module refuses."""
    rng = random.Random(11)
    taken = 0
    for _ in range(20_000):
        text = bytearray(rng.choice(_FUZZ_SEEDS))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text))
            roll = rng.random()
            if roll < 0.4:
                del text[at]
            elif roll < 0.8:
                text.insert(at, rng.choice(_FUZZ_BYTES))
            else:
                text[at] = rng.choice(_FUZZ_BYTES)
        read = kserve_json.loads_numbers(bytes(text))
        if read is None:
            continue
        taken += 1
        assert _as_read(read) == _as_json_read(json.loads(bytes(text))), bytes(text)
    assert taken > 1_000  # the mutations leave many documents whole
