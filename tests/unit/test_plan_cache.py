"""The door's kept slot plans: used while they hold, dropped when the pool or connection changes, bounded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ray_triton_shm._private.serve.protocol.slot_plan import PlanCache, SlotPlan
from ray_triton_shm.errors import PoolClosedError


class _Pool:
    def __init__(self) -> None:
        self.retired = False


class _Inner:
    def __init__(self, model: str) -> None:
        self.pool = _Pool()
        self._pools = {model: self.pool}


class _NodeClient:
    """What the cache reads of a NodeClient: its connection, its restart flag."""

    def __init__(self, inner: _Inner) -> None:
        self.inner: _Inner | None = inner
        self._recheck = False

    @property
    def client(self) -> Any:
        if self.inner is None:
            raise PoolClosedError("NodeClient is closed")
        return self.inner


def _plan(inner: _Inner, model: str = "m") -> SlotPlan:
    return SlotPlan(
        request=SimpleNamespace(model_name=model),
        placeholders={"x": np.empty((0,), np.float32)},
        outputs=None,
        pool=inner.pool,
        inner=inner,
    )


def test_a_kept_plan_is_used_while_its_connection_and_pool_are_current() -> None:
    inner = _Inner("m")
    client, cache, plan = _NodeClient(inner), PlanCache(), _plan(inner)
    cache.put(b"d", plan)
    assert cache.get(client, b"d") is plan
    assert cache.get(client, b"d") is plan
    assert cache.get(client, b"other") is None


@pytest.mark.parametrize("change", ["retired", "new pool", "recheck", "reconnected", "closed"])
def test_a_plan_is_dropped_once_it_no_longer_holds(change: str) -> None:
    inner = _Inner("m")
    client, cache = _NodeClient(inner), PlanCache()
    cache.put(b"d", _plan(inner))
    if change == "retired":
        inner.pool.retired = True
    elif change == "new pool":
        inner._pools["m"] = _Pool()
    elif change == "recheck":
        client._recheck = True
    elif change == "reconnected":
        client.inner = _Inner("m")
    else:
        client.inner = None
    assert cache.get(client, b"d") is None
    assert len(cache) == 0  # made again next time, not looked at again
    client._recheck = False
    client.inner = inner
    inner.pool.retired = False
    inner._pools["m"] = inner.pool
    assert cache.get(client, b"d") is None


def test_the_oldest_plan_goes_first_and_long_descriptions_are_not_kept() -> None:
    inner = _Inner("m")
    client, cache = _NodeClient(inner), PlanCache(max_plans=2, max_key_bytes=8)
    for key in (b"a", b"b", b"c"):
        cache.put(key, _plan(inner))
    assert len(cache) == 2
    assert cache.get(client, b"a") is None
    assert cache.get(client, b"b") is not None and cache.get(client, b"c") is not None
    cache.put(b"c", _plan(inner))  # a key kept already replaces its plan, evicting nothing
    assert cache.get(client, b"b") is not None
    cache.put(b"x" * 9, _plan(inner))
    assert cache.get(client, b"x" * 9) is None and len(cache) == 2


@pytest.mark.parametrize("bounds", [{"max_plans": 0}, {"max_key_bytes": -1}, {"max_plans": True}])
def test_bounds_must_be_positive_integers(bounds: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        PlanCache(**bounds)
