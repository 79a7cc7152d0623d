"""The fault soak's parts that need no server: the front door of a config, the callers'
requests and checks, the classes of errors, and the verdict."""

from __future__ import annotations

import json

import pytest
import yaml
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.cli import soak_caller
from ray_triton_shm._private.cli.cli import build_parser
from ray_triton_shm._private.cli.soak_report import Fault, FaultSoakReport, FrontDoor, front_door, judge
from ray_triton_shm.errors import ConfigError


def _config(tmp_path, **top):
    spec = {
        "http_options": {"host": "0.0.0.0", "port": 8100},
        "applications": [
            {"name": "a", "route_prefix": "/a", "import_path": "ray_triton_shm.serve:app"},
            {"name": "b", "route_prefix": "/b", "import_path": "ray_triton_shm.serve:app"},
        ],
        **top,
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_front_door_is_the_configs_ports_unless_given(tmp_path):
    grpc = {"port": 9100, "grpc_servicer_functions": ["ray_triton_shm.serve.add_kserve_grpc_servicer"]}
    path = _config(tmp_path, grpc_options=grpc)
    door = front_door(path)
    assert (door.host, door.http_port, door.grpc_port, door.app) == ("127.0.0.1", 8100, 9100, "a")
    assert door.http_url == "127.0.0.1:8100/a" and door.grpc_url == "127.0.0.1:9100"
    assert door.protocols == ("http", "grpc")
    moved = front_door(path, http_port=30000, grpc_port=40000, app="b", host="10.0.0.1")
    assert (moved.http_url, moved.grpc_url) == ("10.0.0.1:30000/b", "10.0.0.1:40000")


def test_front_door_without_a_grpc_servicer_is_http_only(tmp_path):
    door = front_door(_config(tmp_path, grpc_options={"port": 9100}))
    assert door.grpc_port is None and door.protocols == ("http",)


def test_front_door_refusals(tmp_path):
    with pytest.raises(ConfigError, match="no application named 'c'"):
        front_door(_config(tmp_path), app="c")
    with pytest.raises(ConfigError, match="http_port"):
        FrontDoor(host="h", http_port=70000, grpc_port=None)


def test_requests_are_unique_and_every_value_is_checked():
    seen = set()
    for caller in (0, 7):
        for n in range(1, 9):
            model, inputs, expected = soak_caller.make_request(caller, n)
            key = (model, inputs["INPUT0"].tobytes())
            assert key not in seen
            seen.add(key)
            good = {name: value.copy() for name, value in expected.items()}
            assert soak_caller.check(expected, good) is None
            bad = {name: value.copy() for name, value in expected.items()}
            first = next(iter(bad))
            bad[first].flat[-1] += 1
            assert "1 of" in soak_caller.check(expected, bad)
            assert "missing" in soak_caller.check(expected, {})
            assert "expected" in soak_caller.check(expected, {k: v[:, :1] for k, v in good.items()})


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InferenceServerException("cannot reach Triton", status="503"), "http 503"),
        (
            InferenceServerException(
                "an exception occurred in the client while decoding the response: x\nresponse: Internal",
                status="500",
            ),
            "untyped http 500",
        ),
        (InferenceServerException("internal error (KeyError)", status="500"), "untyped http 500"),
        (
            InferenceServerException(
                "[UNAVAILABLE] cannot reach Triton: Connection refused", "StatusCode.UNAVAILABLE"
            ),
            "grpc UNAVAILABLE",
        ),
        (
            InferenceServerException(
                "failed to connect to all addresses; last error: Connection refused", "StatusCode.UNAVAILABLE"
            ),
            "connection refused",
        ),
        (InferenceServerException("Socket closed", "StatusCode.UNAVAILABLE"), "connection reset"),
        (InferenceServerException("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"), "timeout"),
        (
            InferenceServerException(
                "The actor died unexpectedly before finishing this task.\n\tactor_id: 15",
                "StatusCode.INTERNAL",
            ),
            "untyped grpc INTERNAL",
        ),
        (InferenceServerException("", "StatusCode.INVALID_ARGUMENT"), "untyped grpc INVALID_ARGUMENT"),
        (InferenceServerException("boom", "StatusCode.UNKNOWN"), "untyped grpc UNKNOWN"),
        (ConnectionRefusedError(111, "refused"), "connection refused"),
        (ConnectionResetError(104, "reset"), "connection reset"),
        (HTTPConnectionClosed("connection closed."), "connection reset"),
        (TimeoutError("timed out"), "timeout"),
        (ValueError("bad"), "untyped ValueError"),
    ],
)
def test_errors_are_classified(error, kind):
    assert soak_caller.classify(error) == kind


def _caller(protocol, correct_by_second, events, wrong=0):
    return {
        "caller": 0,
        "protocol": protocol,
        "requests": sum(correct_by_second.values()) + len(events) + wrong,
        "correct": sum(correct_by_second.values()),
        "wrong": wrong,
        "errors": {kind: sum(1 for _, k in events if k == kind) for _, kind in events},
        "samples": {kind: ["..."] for _, kind in events},
        "correct_by_second": {str(k): v for k, v in correct_by_second.items()},
        "events": events,
    }


def _report(callers, faults):
    door = FrontDoor(host="127.0.0.1", http_port=8100, grpc_port=9100)
    report = FaultSoakReport(door, callers=callers, faults=faults, began=100.0, ended=160.0)
    judge(report, [f.target for f in faults])
    return report


def _fault(target, at):
    return Fault(target, pid=1, injected_at=at, gone=True, replaced_by=2, recovered_at=at + 3)


def test_a_clean_run_passes_and_errors_are_counted_by_window():
    every_second = {s: 5 for s in range(100, 160)}
    callers = [
        _caller("http", every_second, [(121.5, "http 503")]),
        _caller("grpc", every_second, [(141.0, "connection refused")]),
    ]
    report = _report(callers, [_fault("replica", 120.0), _fault("triton", 140.0)])
    assert report.problems == []
    assert [w.label for w in report.windows] == [
        "before the faults",
        "after the replica fault",
        "after the triton fault",
    ]
    assert report.windows[1].errors == {"http 503": 1} and report.windows[2].errors == {
        "connection refused": 1
    }
    assert report.windows[2].correct == {"grpc": 100, "http": 100}
    assert "PASSED" in report.summary()


def test_every_failure_is_a_problem():
    quiet_after = {s: 5 for s in range(100, 130)}  # nothing correct after +30 s
    callers = [
        _caller("http", quiet_after, [(125.0, "untyped http 500")], wrong=1),
        _caller("grpc", {s: 5 for s in range(100, 160)}, []),
    ]
    lost = Fault("node-actor", pid=3, injected_at=140.0, gone=True)  # never recovered
    report = _report(callers, [_fault("replica", 120.0), lost])
    report.leftover_segments = ["rtshm_1_2_node_x"]
    judge(report, ["replica", "node-actor", "triton"])
    text = "; ".join(report.problems)
    for words in (
        "wrong answers",
        "not in Triton's shape",
        "faults injected",
        "fault node-actor: gone=True, recovered=False",
        "no correct http answer after the node-actor fault",
        "segments left",
    ):
        assert words in text
    assert "FAILED" in report.summary()
    json.dumps([w.__dict__ for w in report.windows])  # plain data


def test_cli_parses_soak_faults():
    args = build_parser().parse_args(["soak-faults", "--duration", "60", "--http-port", "30000"])
    assert (args.duration, args.callers, args.http_port, args.grpc_port) == (60.0, 8, 30000, None)
    assert args.faults == "replica,node-actor,triton"
