"""The front door inside Serve beside Serve's own proxies: rolling update, hung replica, autoscaling.

Each scenario runs 8 external callers (unmodified ``tritonclient``, 4 HTTP and 4
gRPC, threads outside Ray, every output checked, a new connection after a
failed call) against the shipped app (``deployments/triton_shm.yaml``, or
``triton_shm_autoscaling.yaml``) on free ports, through one path: the front door
(the replicas' own listeners) or Serve's proxies (HTTP and gRPC). The
integration tests run the scenarios on the front door; this module's ``main``
runs them on both paths in one Ray and prints the table::

    python -m ray_triton_shm._private.bench.citizen            # both paths, about 8 minutes
    python -m ray_triton_shm._private.bench.citizen --paths frontdoor
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from ray import serve

from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.node import shutdown_node_actors
from ray_triton_shm.serve import run_config_file

REPO_DEPLOYMENTS = Path(__file__).resolve().parents[3] / "deployments"
SHIPPED = REPO_DEPLOYMENTS / "triton_shm.yaml"
AUTOSCALING = REPO_DEPLOYMENTS / "triton_shm_autoscaling.yaml"
N = 4096
"""Floats a call sends (16 KB): through a slot."""


@dataclass
class Tally:
    """What the callers saw: calls answered right, failed (when, protocol, why), answered wrong."""

    ok: int = 0
    failed: list[tuple[float, str, str]] = field(default_factory=list)
    wrong: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Target:
    """Where callers call: HTTP and gRPC addresses, and the gRPC metadata the path needs."""

    http_url: str
    grpc_url: str
    grpc_headers: dict[str, str] | None = None


_OWN_CONNECTION = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", 2**31 - 1),  # tritonclient's own, which channel_args replace
    ("grpc.max_receive_message_length", 2**31 - 1),
]


class Callers:
    """``count`` threads calling the identity model (half HTTP, half gRPC) until :meth:`stop`.

    Args:
        target: Where to call.
        count: Threads.
        timeout_s: Each call's time limit.
    """

    def __init__(self, target: Target, count: int = 8, timeout_s: float = 5.0) -> None:
        self.tally = Tally()
        self._target = target
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=("http" if i % 2 == 0 else "grpc", i), daemon=True)
            for i in range(count)
        ]

    def __enter__(self) -> Callers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> Tally:
        """Stop the callers; returns what they saw."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        return self.tally

    def _client(self, kind: str) -> Any:
        if kind == "http":
            return httpclient.InferenceServerClient(
                self._target.http_url, connection_timeout=self._timeout_s, network_timeout=self._timeout_s
            )
        # A caller that gives up on its client opens a new connection: a subchannel of its own. With
        # grpc's process-wide pool, a new client could share the closed one's connection (a hung
        # replica's, say) while that one is still closing.
        return grpcclient.InferenceServerClient(self._target.grpc_url, channel_args=_OWN_CONNECTION)

    def _call(self, kind: str, client: Any, x: np.ndarray) -> np.ndarray:
        if kind == "http":
            tensor = httpclient.InferInput("INPUT0", [1, N], "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer("identity", [tensor]).as_numpy("OUTPUT0")
        tensor = grpcclient.InferInput("INPUT0", [1, N], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(
            "identity", [tensor], client_timeout=self._timeout_s, headers=self._target.grpc_headers
        )
        return result.as_numpy("OUTPUT0")

    def _run(self, kind: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        client = None
        while not self._stop.is_set():
            x = rng.random((1, N), dtype=np.float32)
            try:
                if client is None:
                    client = self._client(kind)
                y = self._call(kind, client, x)
            except Exception as e:
                with self.tally.lock:
                    self.tally.failed.append((time.monotonic(), kind, str(e)[:200]))
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.05)
                continue
            with self.tally.lock:
                if np.array_equal(y, x):
                    self.tally.ok += 1
                else:
                    self.tally.wrong += 1
        if client is not None:
            client.close()


def app_spec(path: Path, **deployment: Any) -> dict[str, Any]:
    """The Serve config at ``path``, on free ports, the identity pool sized for the callers."""
    spec = yaml.safe_load(path.read_text())
    serve_http, serve_grpc, door_http, door_grpc = free_ports("127.0.0.1", 4)
    spec["http_options"]["port"] = serve_http
    spec["grpc_options"] = {
        "port": serve_grpc,
        "grpc_servicer_functions": ["ray_triton_shm.serve.add_kserve_grpc_servicer"],
    }
    application = spec["applications"][0]
    door = application["args"]["frontdoor"]
    door.update({"http_port": door_http, "grpc_port": door_grpc})
    application["args"]["pools"] = {
        "identity": {"slots": 8, "max_batch_size": 1, "max_shapes": {"INPUT0": [N], "OUTPUT0": [N]}}
    }
    application["deployments"][0].update(deployment)
    return spec


def target_of(spec: dict[str, Any], path: str) -> Target:
    """Where the callers of ``path`` (``frontdoor`` or ``serve``) call the app of ``spec``."""
    application = spec["applications"][0]
    if path == "frontdoor":
        door = application["args"]["frontdoor"]
        return Target(f"127.0.0.1:{door['http_port']}", f"127.0.0.1:{door['grpc_port']}")
    return Target(
        f"127.0.0.1:{spec['http_options']['port']}",
        f"127.0.0.1:{spec['grpc_options']['port']}",
        {"application": application["name"]},
    )


def deploy(spec: dict[str, Any], directory: Path, name: str) -> Any:
    """Deploy ``spec`` (written to ``directory/name``); returns the app's handle."""
    path = directory / name
    path.write_text(yaml.safe_dump(spec))
    return run_config_file(str(path))[spec["applications"][0]["name"]]


_PIDS: dict[str, int] = {}


def replicas(app: str = "triton") -> dict[str, int]:
    """{replica actor name: pid} of the app's replicas alive now (a new one's pid once it answers)."""
    names = sorted(replica_names(app))
    for name in names:
        if name not in _PIDS:
            actor = ray.get_actor(name, namespace="serve")
            _PIDS[name] = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    return {name: _PIDS[name] for name in names}


def replica_names(app: str = "triton") -> set[str]:
    """The names of the app's replica actors now, without asking them anything."""
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    }


def wait_until(predicate: Any, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def rolling_update(directory: Path, path: str) -> dict[str, Any]:
    """Two redeploys under the callers: a deployment option changed (each of the 2 replicas replaced),
    then an app argument changed and one replica fewer (Serve stops both old replicas before
    the new one starts)."""
    spec = app_spec(SHIPPED)
    deploy(spec, directory, "first.yaml")
    before = replicas()
    application = spec["applications"][0]
    with Callers(target_of(spec, path)) as callers:
        time.sleep(3)
        application["deployments"][0]["ray_actor_options"] = {"num_cpus": 0.26}
        deploy(spec, directory, "second.yaml")
        replaced = wait_until(lambda: len(replicas()) == 2 and not set(replicas()) & set(before), 120)
        time.sleep(2)
        middle = replicas()
        application["args"]["frontdoor"]["drain_timeout_s"] = 9.0
        application["deployments"][0]["num_replicas"] = 1
        deploy(spec, directory, "third.yaml")
        shrunk = wait_until(lambda: len(replicas()) == 1 and not set(replicas()) & set(middle), 120)
        time.sleep(3)
        tally = callers.stop()
    door = application["args"]["frontdoor"]
    return {
        "replicas_before": len(before),
        "replaced": replaced,
        "replaced_by_one": shrunk,
        "door_ports": [door["http_port"], door["grpc_port"]],
        **_counts(tally),
    }


def hung_replica(directory: Path, path: str, stopped_s: float = 30.0) -> dict[str, Any]:
    """Stop one of two replicas (SIGSTOP) for ``stopped_s`` under the callers."""
    spec = app_spec(SHIPPED)
    deploy(spec, directory, "hung.yaml")
    alive = replicas()
    hung_name, hung_pid = sorted(alive.items())[0]
    others = set(alive) - {hung_name}
    with Callers(target_of(spec, path)) as callers:
        time.sleep(3)
        stopped_at = time.monotonic()
        os.kill(hung_pid, signal.SIGSTOP)
        try:
            started = wait_until(lambda: bool(replica_names() - others - {hung_name}), 60)
            replacement_s = time.monotonic() - stopped_at
            time.sleep(max(0.0, stopped_s - (time.monotonic() - stopped_at)))
        finally:
            try:
                os.kill(hung_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        tally = callers.stop()
    during = [f for f in tally.failed if f[0] >= stopped_at]
    return {
        "replacement_started": started,
        "replacement_started_s": round(replacement_s, 1),
        "failed_before_stop": len(tally.failed) - len(during),
        **_counts(tally),
    }


AUTOSCALING_CALLERS = 16
"""Callers of the autoscaling scenario: enough to keep one replica's calls above the config's
``target_ongoing_requests`` (2). A call counts as demand while the replica works on it or it
waits for a slot, not while its client sends or reads: 8 Python callers in one process keep
about 2 calls so (their own pace is the rest), 16 about 11 (with 8 slots)."""


def autoscaling(
    directory: Path, path: str, load_s: float = 45.0, callers: int = AUTOSCALING_CALLERS
) -> dict[str, Any]:
    """The autoscaling config under ``callers`` callers for ``load_s``, then idle: replicas over time."""
    spec = app_spec(AUTOSCALING)
    deploy(spec, directory, "autoscaling.yaml")
    start = time.monotonic()
    timeline: list[tuple[float, int]] = []

    def sample() -> int:
        count = len(replica_names())
        if not timeline or timeline[-1][1] != count:
            timeline.append((round(time.monotonic() - start, 1), count))
        return count

    with Callers(target_of(spec, path), count=callers) as load:
        deadline = time.monotonic() + load_s
        while time.monotonic() < deadline:
            sample()
            time.sleep(1)
        tally = load.stop()
    peak = max(n for _, n in timeline)
    unloaded_at = round(time.monotonic() - start, 1)
    down = wait_until(lambda: sample() == 1, 120, 1.0)
    return {
        "timeline": timeline,
        "peak": peak,
        "load_ended_s": unloaded_at,
        "back_to_1": down,
        **_counts(tally),
    }


def _counts(tally: Tally) -> dict[str, Any]:
    return {"ok": tally.ok, "failed": len(tally.failed), "wrong": tally.wrong, "failures": tally.failed[:10]}


SCENARIOS = {"rolling_update": rolling_update, "hung_replica": hung_replica, "autoscaling": autoscaling}


def main(argv: list[str] | None = None) -> int:
    """Run every scenario on each path in one Ray; print the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paths", default="frontdoor,serve")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: list[tuple[str, str, dict[str, Any]]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for scenario in args.scenarios.split(","):
                for path in args.paths.split(","):
                    result = SCENARIOS[scenario](Path(tmp), path)
                    serve.shutdown()
                    results.append((scenario, path, result))
                    print(scenario, path, {k: v for k, v in result.items() if k != "failures"}, flush=True)
    finally:
        serve.shutdown()
        shutdown_node_actors()
        ray.shutdown()
    print()
    for scenario, path, result in results:
        print(
            f"{scenario:15s} {path:10s} ok {result['ok']:6d} failed {result['failed']:4d}"
            f" wrong {result['wrong']}"
            + "".join(
                f" {k}={v}" for k, v in result.items() if k not in ("ok", "failed", "wrong", "failures")
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
