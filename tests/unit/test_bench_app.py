"""The benchmark's rows for your own deployment (requests/s of the image app, shm vs gRPC)."""

from __future__ import annotations

import pytest

from ray_triton_shm._private.bench import report
from ray_triton_shm._private.bench.app_methods import app_records, node_args_of
from ray_triton_shm._private.bench.runner import Record


def _record(method: str, mb_s: float, ok: bool = True) -> Record:
    return Record(method, 150_000, 4, mb_s, 10.0, 20.0, 40, ok, group="app", error=None if ok else "boom")


def test_requests_per_second_and_ratio():
    records = app_records([_record("app-image-shm", 15.0), _record("app-image-grpc", 7.5)])
    assert [r.rows_per_s for r in records] == pytest.approx([100.0, 50.0])
    rows = report.app_rows(records)
    assert [row[3] for row in rows] == ["100.0", "50.0"]
    assert [row[6] for row in rows] == ["2.00", "1.00"]
    assert report.core_rows(records) == []  # not in the core table
    assert "app-image-shm" in report.app_table(records)


def test_failed_cells_have_no_rate():
    records = app_records([_record("app-image-shm", 0.0, ok=False), _record("app-image-grpc", 7.5)])
    row = report.app_rows(records)[0]
    assert row[3] == "-" and row[-1].startswith("FAILED")


def test_node_args_rebuild_the_same_config():
    from ray_triton_shm.node import NodeConfig

    config = NodeConfig.from_args(
        model_repository="examples",
        server={"protect_shm_api": False},
        pools={"identity": {"slots": 8, "max_shapes": {"INPUT0": (4,), "OUTPUT0": (4,)}}},
    )
    assert NodeConfig.from_args(**node_args_of(config)).fingerprint() == config.fingerprint()
