"""Front-door call records: queued by the calls' threads, recorded in batches by a thread of their own."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.logging_utils import log_to_stderr_filter

from ray_triton_shm._private.serve.door.batched_observer import BatchedObserver
from ray_triton_shm._private.serve.door.calls import CallGate, CallRecord
from ray_triton_shm._private.serve.frontdoor_observe import FrontDoorObserver
from tests.helpers import wait_for


class _Batches:
    """A ``record_all`` that keeps each batch and the thread it ran in."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[CallRecord, float]]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, batch) -> None:
        with self.lock:
            self.batches.append(list(batch))
            self.threads.add(threading.current_thread().name)

    def records(self) -> list[CallRecord]:
        with self.lock:
            return [record for batch in self.batches for record, _ in batch]


def test_calls_only_queue_their_records_and_one_thread_records_them_in_order() -> None:
    batches = _Batches()
    observer = BatchedObserver(batches, every_s=0.05, name="observer-under-test")
    gate = CallGate(observer=observer)
    try:
        before = time.time()
        for n in range(20):
            with gate.running("grpc", "ModelInfer", f"/route/{n}") as call:
                call.record.status = "OK"
        after = time.time()
        assert wait_for(lambda: len(batches.records()) == 20, 10, 0.02)
        assert [r.route for r in batches.records()] == [f"/route/{n}" for n in range(20)]
        assert batches.threads == {"observer-under-test"}  # never the calls' thread
        ended = [t for batch in batches.batches for _, t in batch]
        assert ended == sorted(ended) and before <= ended[0] and ended[-1] <= after
    finally:
        observer.close()
    assert not observer.running


def test_close_records_what_is_queued_and_a_later_record_at_once() -> None:
    batches = _Batches()
    observer = BatchedObserver(batches, every_s=60.0)  # never on its own within the test
    observer(CallRecord("http", "POST", "/a", "200"))
    observer(CallRecord("http", "POST", "/b", "200"))
    assert batches.records() == []
    observer.close()
    observer.close()  # idempotent
    assert [r.route for r in batches.records()] == ["/a", "/b"]
    assert not observer.running
    observer(CallRecord("http", "POST", "/c", "503"))
    assert [r.route for r in batches.records()] == ["/a", "/b", "/c"]
    assert threading.current_thread().name in batches.threads


def test_a_failed_batch_is_logged_and_later_ones_are_recorded(caplog) -> None:
    batches = _Batches()
    failed = []

    def record_all(batch) -> None:
        if not failed:
            failed.append(len(batch))
            raise RuntimeError("metrics are down")
        batches(batch)

    observer = BatchedObserver(record_all, every_s=60.0)
    try:
        with caplog.at_level(logging.WARNING):
            observer(CallRecord("grpc", "ModelInfer", "/x", "OK"))
            observer.flush()
        assert failed == [1] and "1 call records were not recorded" in caplog.text
        observer(CallRecord("grpc", "ModelInfer", "/y", "OK"))
        observer.flush()
        assert [r.route for r in batches.records()] == ["/y"]
    finally:
        observer.close()


def test_a_call_that_finds_the_queue_full_records_it_itself() -> None:
    batches = _Batches()
    observer = BatchedObserver(batches, every_s=60.0, max_queued=3)
    try:
        for name in ("/a", "/b"):
            observer(CallRecord("http", "POST", name, "404"))
        assert batches.records() == []
        observer(CallRecord("http", "POST", "/c", "404"))  # the third: the queue is full
        assert [r.route for r in batches.records()] == ["/a", "/b", "/c"]
        assert batches.threads == {threading.current_thread().name}
        observer(CallRecord("http", "POST", "/d", "404"))
        assert len(batches.records()) == 3  # queued again
    finally:
        observer.close()
    assert [r.route for r in batches.records()] == ["/a", "/b", "/c", "/d"]


@pytest.mark.parametrize("every_s", [0, -1.0])
def test_the_interval_must_be_positive(every_s: float) -> None:
    with pytest.raises(ValueError, match="every_s must be positive"):
        BatchedObserver(lambda batch: None, every_s=every_s)


@pytest.mark.parametrize("max_queued", [0, -1, 1.5, True])
def test_the_queue_holds_at_least_one_record(max_queued) -> None:
    with pytest.raises(ValueError, match="max_queued must be an integer of at least 1"):
        BatchedObserver(lambda batch: None, max_queued=max_queued)


class _Metric:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append((value, dict(tags or {})))

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append((value, dict(tags or {})))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _observer(access_log: bool) -> FrontDoorObserver:
    context = SimpleNamespace(
        app_name="app",
        deployment="TritonDeployment",
        replica_tag="r1",
        _deployment_config=SimpleNamespace(logging_config={"enable_access_log": access_log}),
    )
    observer = FrontDoorObserver(context)
    observer._requests = _Metric()  # type: ignore[assignment]
    observer._latency = _Metric()  # type: ignore[assignment]
    return observer


@pytest.fixture
def serve_lines():
    lines = _Lines()
    logger = logging.getLogger("ray.serve")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def test_a_batch_counts_once_per_label_set_and_logs_each_call_dated_when_it_ended(serve_lines) -> None:
    observer = _observer(access_log=True)
    batch = [
        (CallRecord("grpc", "ModelInfer", "/m", "OK", 0.0021), 1000.25),
        (CallRecord("http", "POST", "/v2/models/x/infer", "200", 0.004), 1001.5),
        (CallRecord("grpc", "ModelInfer", "/m", "OK", 0.003), 1002.75),
        (CallRecord("grpc", "ModelInfer", "/m", "", 0.001), 1003.0),  # the client went
    ]
    observer(batch)
    grpc_ok = {"route": "/m", "protocol": "grpc", "method": "ModelInfer", "status_code": "OK"}
    http_ok = {"route": "/v2/models/x/infer", "protocol": "http", "method": "POST", "status_code": "200"}
    gone = {**grpc_ok, "status_code": "-"}
    assert sorted(observer._requests.calls, key=lambda c: sorted(c[1].items())) == sorted(
        [(2, grpc_ok), (1, http_ok), (1, gone)], key=lambda c: sorted(c[1].items())
    )
    assert [(round(v, 6), t) for v, t in observer._latency.calls] == [
        (2.1, grpc_ok),
        (4.0, http_ok),
        (3.0, grpc_ok),
        (1.0, gone),
    ]
    lines = serve_lines.records
    assert [line.getMessage() for line in lines] == [
        "gRPC /m OK 2.1ms",
        "POST /v2/models/x/infer 200 4.0ms",
        "gRPC /m OK 3.0ms",
        "gRPC /m - 1.0ms",
    ]
    assert [line.created for line in lines] == [1000.25, 1001.5, 1002.75, 1003.0]
    assert [line.msecs for line in lines] == [250.0, 500.0, 750.0, 0.0]
    assert all(line.serve_access_log and line.replica == "r1" for line in lines)
    # As Serve's own access lines: in the replica's log file, not on its stderr (the driver's console).
    assert not any(log_to_stderr_filter(line) for line in lines)
    assert [line.route for line in lines] == ["/m", "/v2/models/x/infer", "/m", "/m"]


def test_no_access_log_lines_where_the_deployment_turns_them_off(serve_lines) -> None:
    observer = _observer(access_log=False)
    observer([(CallRecord("http", "POST", "/v2/models/x/infer", "200", 0.004), 1001.5)])
    assert serve_lines.records == []
    assert len(observer._requests.calls) == 1 and len(observer._latency.calls) == 1
