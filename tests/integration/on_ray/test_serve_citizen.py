"""The front door inside Serve, under 8 external callers: a rolling update, a hung replica, autoscaling.

A local Ray, the node's real Triton, the shipped configs (deployments/triton_shm.yaml
and triton_shm_autoscaling.yaml) on free ports. The callers are unmodified
tritonclient clients (4 HTTP, 4 gRPC) in threads outside Ray, each checking
every output and opening a new connection after a failed call, as a client
told to go away does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

from tests.helpers import free_port, wait_for

from .conftest import REPO, frontdoor_on_free_ports, teardown_ray

pytestmark = pytest.mark.slow

SHIPPED = REPO / "deployments" / "triton_shm.yaml"
AUTOSCALING = REPO / "deployments" / "triton_shm_autoscaling.yaml"
N = 4096  # floats a call: small, through a slot


@dataclass
class Tally:
    ok: int = 0
    failed: list[tuple[float, str, str]] = field(default_factory=list)
    wrong: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Callers:
    """8 threads calling the identity model through the front door until stopped."""

    def __init__(self, http_url: str, grpc_url: str, count: int = 8, timeout_s: float = 5.0) -> None:
        self.tally = Tally()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._run, args=("http" if i % 2 == 0 else "grpc", http_url, grpc_url, i), daemon=True
            )
            for i in range(count)
        ]
        self._timeout_s = timeout_s

    def __enter__(self) -> Callers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> Tally:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        return self.tally

    def _client(self, kind: str, http_url: str, grpc_url: str):
        if kind == "http":
            return httpclient.InferenceServerClient(
                http_url, connection_timeout=self._timeout_s, network_timeout=self._timeout_s
            )
        return grpcclient.InferenceServerClient(grpc_url)

    def _call(self, kind: str, client, x: np.ndarray) -> np.ndarray:
        module = httpclient if kind == "http" else grpcclient
        tensor = module.InferInput("INPUT0", [1, N], "FP32")
        tensor.set_data_from_numpy(x)
        if kind == "http":
            return client.infer("identity", [tensor]).as_numpy("OUTPUT0")
        return client.infer("identity", [tensor], client_timeout=self._timeout_s).as_numpy("OUTPUT0")

    def _run(self, kind: str, http_url: str, grpc_url: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        client = None
        while not self._stop.is_set():
            x = rng.random((1, N), dtype=np.float32)
            try:
                if client is None:
                    client = self._client(kind, http_url, grpc_url)
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


def _spec(path: Path, **deployment) -> dict:
    spec = frontdoor_on_free_ports(yaml.safe_load(path.read_text()))
    spec["http_options"]["port"] = free_port()
    spec.pop("grpc_options", None)
    application = spec["applications"][0]
    application["args"]["pools"] = {
        "identity": {"slots": 8, "max_batch_size": 1, "max_shapes": {"INPUT0": [N], "OUTPUT0": [N]}}
    }
    application["deployments"][0].update(deployment)
    return spec


def _deploy(tmp_path: Path, spec: dict, name: str) -> tuple[object, str, str]:
    from ray_triton_shm.serve import run_config_file

    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    application = spec["applications"][0]
    door = application["args"]["frontdoor"]
    handle = run_config_file(str(path))[application["name"]]
    return handle, f"127.0.0.1:{door['http_port']}", f"127.0.0.1:{door['grpc_port']}"


_PIDS: dict[str, int] = {}  # every replica seen: its pid (asked once, while it answers)
_OWNERS: set[int] = set()  # every process whose /dev/shm segments must be gone at the end


def _replicas(app: str = "triton") -> dict[str, int]:
    """{replica actor name: pid} of the app's replicas alive now."""
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]
    for name in names:
        if name not in _PIDS:
            actor = ray.get_actor(name, namespace="serve")
            _PIDS[name] = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            _OWNERS.add(_PIDS[name])
    return {name: _PIDS[name] for name in names}


def _node_owners(handle) -> None:
    where = handle.whereami.remote().result()
    _OWNERS.update({where["actor_pid"], where["triton_pid"]})


@pytest.fixture(scope="module")
def ray_up():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        teardown_ray()
    assert wait_for(
        lambda: not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in _OWNERS)],
        30,
        0.5,
    ), "segments left in /dev/shm"


def test_a_rolling_update_under_load_drops_no_call(ray_up, tmp_path) -> None:
    from ray import serve

    spec = _spec(SHIPPED)
    handle, http_url, grpc_url = _deploy(tmp_path, spec, "first.yaml")
    _node_owners(handle)
    before = _replicas()
    assert len(before) == 2
    with Callers(http_url, grpc_url) as callers:
        time.sleep(3)
        spec["applications"][0]["deployments"][0]["ray_actor_options"] = {
            "num_cpus": 0.26
        }  # every replica replaced
        _deploy(tmp_path, spec, "second.yaml")
        assert wait_for(lambda: len(_replicas()) == 2 and not set(_replicas()) & set(before), 120, 0.5)
        time.sleep(3)
        tally = callers.stop()
    print(f"rolling update: ok {tally.ok}, failed {len(tally.failed)}, wrong {tally.wrong}")
    assert tally.ok > 100
    assert tally.wrong == 0
    assert tally.failed == []
    serve.delete("triton")


def test_a_hung_replica_takes_no_new_connection_and_is_replaced(ray_up, tmp_path) -> None:
    from ray import serve

    spec = _spec(SHIPPED)
    handle, http_url, grpc_url = _deploy(tmp_path, spec, "hung.yaml")
    _node_owners(handle)
    replicas = _replicas()
    assert len(replicas) == 2
    hung_name, hung_pid = sorted(replicas.items())[0]
    with Callers(http_url, grpc_url) as callers:
        time.sleep(3)
        stopped_at = time.monotonic()
        os.kill(hung_pid, signal.SIGSTOP)
        try:
            replaced = wait_for(lambda: len([r for r in _replicas() if r != hung_name]) == 2, 60, 0.5)
            replaced_s = time.monotonic() - stopped_at
            time.sleep(max(0.0, 30 - (time.monotonic() - stopped_at)))
        finally:
            try:
                os.kill(hung_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        tally = callers.stop()
    after = [f for f in tally.failed if f[0] >= stopped_at]
    print(
        f"hung replica: ok {tally.ok}, failed {len(after)} (held at most 8 connections), "
        f"wrong {tally.wrong}, replaced after {replaced_s:.1f} s"
    )
    assert replaced, "Serve did not replace the hung replica"
    assert tally.wrong == 0
    assert len(after) <= 8, after  # at most the calls on connections it held when stopped
    assert len(tally.failed) == len(after)
    serve.delete("triton")


def test_autoscaling_follows_front_door_load(ray_up, tmp_path) -> None:
    from ray import serve

    spec = _spec(AUTOSCALING)
    handle, http_url, grpc_url = _deploy(tmp_path, spec, "autoscaling.yaml")
    _node_owners(handle)
    assert len(_replicas()) == 1
    counts: list[tuple[float, int]] = []
    start = time.monotonic()
    with Callers(http_url, grpc_url) as callers:
        scaled_up = wait_for(
            lambda: counts.append((time.monotonic() - start, len(_replicas()))) or counts[-1][1] >= 2, 90, 1.0
        )
        tally = callers.stop()
    scaled_down = wait_for(
        lambda: counts.append((time.monotonic() - start, len(_replicas()))) or counts[-1][1] == 1, 120, 1.0
    )
    print(
        "replicas over time (s, replicas):", [(round(t), n) for t, n in counts[:: max(1, len(counts) // 20)]]
    )
    assert scaled_up, "front-door load did not scale the app up"
    assert scaled_down, "the app did not scale back down after the load"
    assert tally.wrong == 0 and tally.ok > 0
    serve.delete("triton")
