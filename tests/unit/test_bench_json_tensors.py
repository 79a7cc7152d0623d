"""The JSON tensors benchmark: both ways measured, the extension put back after."""

from __future__ import annotations

from ray_triton_shm._private.bench import json_tensors
from ray_triton_shm._private.serve.protocol import kserve_json


def test_each_step_is_measured_both_ways_and_the_extension_is_put_back() -> None:
    built = kserve_json._kserve_json
    rows = json_tensors.measure(64 * 1024, repeat=1)
    assert kserve_json._kserve_json is built
    assert [row["step"] for row in rows] == ["decode_request", "encode_response"]
    for row in rows:
        assert row["C ms"] > 0 and row["json module ms"] > 0
    decode = rows[0]
    assert decode["C peak MiB"] < decode["json module peak MiB"]  # a buffer, not an object per number
    table = json_tensors.table(rows)
    assert table.count("\n") == 3 and "decode_request" in table
