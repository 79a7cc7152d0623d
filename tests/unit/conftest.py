"""Fixtures shared by the unit tests: model configs as Triton returns them, and a leak check.

Unit tests never start Triton or Ray.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.shm.layout import ModelLayout, layout_from_config
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm.config import PoolConfig
from tests.helpers import assert_built_from_current_source

# Model configurations shaped like ``get_model_config(model, as_json=True)["config"]``:
# int64 dims come back as strings, datatypes carry the ``TYPE_`` prefix.
IDENTITY_CONFIG: dict[str, Any] = {
    "name": "identity",
    "platform": "",
    "backend": "python",
    "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": ["4"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["4"], "label_filename": ""}],
    "instance_group": [{"name": "identity_0", "kind": "KIND_CPU", "count": 1}],
}

MULTI_IO_CONFIG: dict[str, Any] = {
    "name": "multi_io",
    "backend": "python",
    "max_batch_size": 4,
    "input": [
        {"name": "IMAGE", "data_type": "TYPE_FP32", "dims": ["3", "-1", "-1"]},
        {"name": "IDS", "data_type": "TYPE_INT64", "dims": ["10"]},
    ],
    "output": [
        {"name": "SCORES", "data_type": "TYPE_FP16", "dims": ["-1"]},
        {"name": "MASK", "data_type": "TYPE_BOOL", "dims": ["2", "2"]},
    ],
}

MULTI_IO_SHAPES = {"IMAGE": (3, 32, 48), "SCORES": (100,)}

UNBATCHED_CONFIG: dict[str, Any] = {
    "name": "unbatched",
    "backend": "python",
    "max_batch_size": 0,
    "input": [
        {"name": "A", "data_type": "TYPE_INT32", "dims": ["2", "3"]},
        {"name": "B", "data_type": "TYPE_UINT8", "dims": ["-1"]},
    ],
    "output": [{"name": "SUM", "data_type": "TYPE_INT32", "dims": ["2", "3"]}],
}


def own_segments() -> set[str]:
    """Names in /dev/shm owned (by name) by this test process."""
    return set(sweep.list_segments(segment.owner_tag() + "_"))


def shm_path(name: str) -> str:
    return os.path.join(segment.SHM_DIR, name)


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    """Every unit test must leave no /dev/shm/rtshm_<this process>_* file behind."""
    before = own_segments()
    yield
    leaked = own_segments() - before
    for name in leaked:
        segment.unlink_segment(name)
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


@pytest.fixture
def identity_config() -> dict[str, Any]:
    """A batched model: FP32 [batch, 4] in and out, max_batch_size 8."""
    return copy.deepcopy(IDENTITY_CONFIG)


@pytest.fixture
def multi_io_config() -> dict[str, Any]:
    """A batched model with variable dims (sized by ``MULTI_IO_SHAPES``) and several dtypes."""
    return copy.deepcopy(MULTI_IO_CONFIG)


@pytest.fixture
def multi_io_shapes() -> dict[str, tuple[int, ...]]:
    return dict(MULTI_IO_SHAPES)


@pytest.fixture
def unbatched_config() -> dict[str, Any]:
    """A model without batching (max_batch_size 0), one variable input dim."""
    return copy.deepcopy(UNBATCHED_CONFIG)


@pytest.fixture
def identity_layout() -> ModelLayout:
    return layout_from_config(IDENTITY_CONFIG, PoolConfig(max_batch_size=2))


@pytest.fixture
def multi_io_layout() -> ModelLayout:
    return layout_from_config(MULTI_IO_CONFIG, PoolConfig(max_shapes=MULTI_IO_SHAPES))


@pytest.fixture
def unbatched_layout() -> ModelLayout:
    return layout_from_config(UNBATCHED_CONFIG, PoolConfig(max_shapes={"B": (16,)}))


@pytest.fixture
def make_pool() -> Iterator[Callable[..., SlotPool]]:
    """Creates pools; closes them at the end and checks their segments are unlinked."""
    pools: list[SlotPool] = []

    def make(layout: ModelLayout, slots: int = 1, **kwargs: Any) -> SlotPool:
        pool = SlotPool.create(layout, slots, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        assert not os.path.exists(shm_path(pool.region_name))


@pytest.fixture(params=["python", "nghttp2"])
def grpc_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each gRPC engine in turn, as what serves the connections of the listeners a test starts."""
    from ray_triton_shm._private.serve.http2 import engine, h2_listener

    if request.param == "nghttp2":
        if not engine.available():
            pytest.skip("the nghttp2 engine was not built (libnghttp2's headers were missing at install)")
        assert_built_from_current_source(engine._h2_engine)
    monkeypatch.setattr(h2_listener, "DEFAULT_ENGINE", request.param)
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_GRPC_ENGINE", request.param)  # replicas run as processes
    return request.param
