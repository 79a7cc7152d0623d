"""The Ray metrics observer's batched records total what one record per event would (no Ray cluster)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from ray_triton_shm._private.node import metrics
from ray_triton_shm._private.triton.observe import EventBatch


class _Recorder:
    """A metric object that keeps what was recorded: per tags, the sum of increments and every observation."""

    def __init__(self) -> None:
        self.calls = 0
        self.total: dict[tuple, float] = defaultdict(float)
        self.values: dict[tuple, list[float]] = defaultdict(list)

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls += 1
        self.total[tuple(sorted(tags.items()))] += value

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls += 1
        self.values[tuple(sorted(tags.items()))].append(value)


def _recorders() -> dict[str, Any]:
    return {name: _Recorder() for name in ("requests", "bytes", "request_seconds", "lease_wait", "errors")}


def _events() -> list[tuple]:
    events: list[tuple] = []
    for i in range(50):
        events.append(("request", "m", "shm" if i % 3 else "grpc", 1000 + i, i / 1000))
        events.append(("lease_wait", "m" if i % 2 else "n", i / 7))
        if i % 10 == 0:
            events.append(("error", "m", "InputError" if i % 20 else "PoolTimeoutError"))
    return events


def _per_event(recorders: dict[str, Any], events: list[tuple]) -> None:
    """One record per event: what the observer did before it batched."""
    for kind, *args in events:
        if kind == "request":
            model, path, nbytes, seconds = args
            tags = {"model": model, "path": path}
            recorders["requests"].inc(1, tags=tags)
            recorders["bytes"].inc(nbytes, tags=tags)
            recorders["request_seconds"].observe(seconds, tags=tags)
        elif kind == "lease_wait":
            recorders["lease_wait"].observe(args[1], tags={"model": args[0]})
        else:
            recorders["errors"].inc(1, tags={"model": args[0], "type": args[1]})


def test_batched_records_total_what_one_record_per_event_does() -> None:
    batch = EventBatch()
    events = _events()
    for kind, *args in events:
        getattr(batch, kind)(*args)
    batched, direct = _recorders(), _recorders()
    metrics._record(batched, batch.drain())
    _per_event(direct, events)
    for name in batched:
        assert dict(batched[name].total) == dict(direct[name].total), name
        assert dict(batched[name].values) == dict(direct[name].values), name
    # The counters: one increment per (model, path) or (model, type), not one per request.
    assert batched["requests"].calls == 2 and batched["bytes"].calls == 2 and batched["errors"].calls == 2
    assert direct["requests"].calls == 50


class _Actor:
    """Stands for the node actor's handle: keeps the traffic reports sent to it."""

    def __init__(self) -> None:
        self.reports: list[list[tuple]] = []
        self.report = self

    def remote(self, rows: list[tuple]) -> None:
        self.reports.append(rows)


def test_the_observer_records_in_the_background_and_on_close(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    recorders = _recorders()
    monkeypatch.setattr(metrics, "_get", lambda: recorders)
    actor = _Actor()
    observer = metrics.RayMetricsObserver(actor)
    try:
        observer.request("m", "shm", 10, 0.5)
        observer.request("m", "shm", 5, 0.25)
        observer.error("m", "InputError")
        deadline = time.monotonic() + 10 * metrics.REPORT_INTERVAL_S + 5
        while recorders["requests"].calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dict(recorders["requests"].total) == {(("model", "m"), ("path", "shm")): 2}
        assert dict(recorders["bytes"].total) == {(("model", "m"), ("path", "shm")): 15}
        assert dict(recorders["errors"].total) == {(("model", "m"), ("type", "InputError")): 1}
        assert actor.reports == [[("m", "shm", 2, 15)]]
        observer.request("m", "grpc", 3, 1.0)
        observer.lease_wait("m", 0.125)
    finally:
        observer.close()
    assert recorders["requests"].total[(("model", "m"), ("path", "grpc"))] == 1
    assert dict(recorders["lease_wait"].values) == {(("model", "m"),): [0.125]}
    assert actor.reports[-1] == [("m", "grpc", 1, 3)]
    assert not observer._reporter.is_alive()
