"""Triton's BYTES serialisation and the v2 protocol's BYTES tensors (JSON and binary), without a server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_triton_shm._private.serve.protocol.kserve import decode_request
from ray_triton_shm._private.serve.protocol.kserve_tensors import deserialize_bytes, serialize_bytes
from ray_triton_shm.errors import InputError


def test_bytes_round_trip_serialised_form() -> None:
    items = np.array([b"", b"a\x00b", "é"], dtype=object)
    blob = serialize_bytes(items)
    assert blob == b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00a\x00b" + b"\x02\x00\x00\x00\xc3\xa9"
    assert deserialize_bytes(blob).tolist() == [b"", b"a\x00b", "é".encode()]
    with pytest.raises(InputError, match="runs past"):
        deserialize_bytes(blob[:-1])
    with pytest.raises(InputError, match="exactly 2"):
        deserialize_bytes(blob, count=2)
    with pytest.raises(InputError, match="4-byte length"):
        deserialize_bytes(b"\x01\x00")


def test_decode_bytes_json_and_binary() -> None:
    head = {"inputs": [{"name": "T", "datatype": "BYTES", "shape": [1, 2], "data": ["ab", "ç"]}]}
    decoded = decode_request(json.dumps(head).encode(), None)
    assert decoded.inputs["T"].tolist() == [[b"ab", "ç".encode()]]
    blob = b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    entry = {"name": "T", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 11}}
    head = {"inputs": [entry]}
    raw = json.dumps(head).encode()
    assert decode_request(raw + blob, len(raw)).inputs["T"].tolist() == [b"ab", b"c"]
    bad = {"inputs": [{"name": "T", "datatype": "BYTES", "shape": [1], "data": [3]}]}
    with pytest.raises(InputError, match="strings"):
        decode_request(json.dumps(bad).encode(), None)
