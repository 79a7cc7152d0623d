"""A Ray cluster of real hosts on one machine, started as cluster.yaml says; a host lost under load.

Hosts are Linux namespaces (:mod:`tests.cluster.hosts`): each has its own
network (an address in 198.18.0.0/15 on a bridge), /dev/shm, /tmp and pid
space. Hosts 1-3 run Ray (``ray start --head`` on 1, ``ray start --address`` on
2 and 3, the commands of cluster.yaml: :mod:`tests.cluster.ray_hosts`) and the
shipped Serve app with the front door and proxies on 0.0.0.0; host 4 is a
client host that runs unmodified tritonclient processes only.

The tests run in order on one cluster: Ray as started; each host's own node
actor, Triton and segments; a client pointed at another host's node actor
fails; then the load: the client host calls every host's front door and Serve
proxy (HTTP and gRPC) while a Ray Data job runs from the head, host 3 is lost
(its pid namespace killed as one), Serve replaces its replica on hosts 1 and 2,
and host 5 joins and takes traffic; last, the head's processes die and the
workers' Ray, Tritons and segments must end. Every answer is checked; the counts
and recovery times are printed and written to ``$RAY_TRITON_SHM_CLUSTER_REPORT``
(default ``.cache/cluster-test.json``).

Run with ``make cluster-test`` (about 6 minutes on 2 cores). Needs root, ``ip``, ``unshare``
and ``nsenter``; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import ray_hosts
from tests.cluster.hosts import Host, Hosts, cmdline, why_not
from tests.helpers import wait_for

_WHY_NOT = why_not()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.alone,
    pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or ""),
]

REPO = ray_hosts.REPO
VENV_BIN = REPO / ".venv" / "bin"
REPORT = Path(os.environ.get("RAY_TRITON_SHM_CLUSTER_REPORT", str(REPO / ".cache" / "cluster-test.json")))
DEPLOYED = "/tmp/triton_shm.yaml"
"""Where cluster.yaml's deploy command writes the config it deploys (the head's /tmp)."""
NUM_CPUS = 2
OBJECT_STORE_BYTES = 200 * 1024 * 1024
REPLICAS = 3
MAX_PER_NODE = 2
FRONT_HTTP, FRONT_GRPC, PROXY_HTTP, PROXY_GRPC = 8100, 8101, 8000, 9000
START_TRIES = 3
START_S = 300.0
"""The longest wait for a Ray node, the app, or a replica (a loaded 2-core machine is slow)."""
SEGMENT_PREFIX = "rtshm_"
DATA_ROWS = 2400


def _check(result: subprocess.CompletedProcess[str], what: str) -> str:
    assert result.returncode == 0, (
        f"{what} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def _auth_env() -> dict[str, str]:
    """Token authentication when the machine has a Ray auth token (Ray 2.60: a GCS and dashboard started
    while ~/.ray/auth_token exists may require it; the hosts share the machine's home, hence its token)."""
    return {"RAY_AUTH_MODE": "token"} if (Path.home() / ".ray" / "auth_token").exists() else {}


def _json_line(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in:\n{text[-3000:]}")


class Cluster:
    """The hosts, who runs what, and the commands the tests run on them."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.head: Host | None = None
        self.workers: list[Host] = []
        self.client: Host | None = None
        self.node_of: dict[str, str] = {}  # host name -> Ray node id
        self.commands: dict[str, list[str]] = {}
        self.start_tries: dict[str, int] = {}

    def start_ray(self, host: Host, role: str) -> None:
        """Run cluster.yaml's start commands of ``role`` on ``host``.

        ``ray start`` gives up when its raylet has not registered within 30 s (fixed in Ray), which a
        loaded 2-core machine can take longer than: the commands run again (``ray stop`` first) up to
        :data:`START_TRIES` times.
        """
        head_address = self.head.address if self.head else host.address
        commands = ray_hosts.start_commands(role, host.address, head_address, NUM_CPUS, OBJECT_STORE_BYTES)
        self.commands[host.name] = commands
        for attempt in range(1, START_TRIES + 1):
            outputs = []
            for command in commands:
                result = host.run(["bash", "-c", command], timeout=START_S, env=_auth_env())
                outputs.append(f"$ {command}\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
                if result.returncode != 0:
                    break
            else:
                self.start_tries[host.name] = attempt
                return
        raise AssertionError(f"{host.name}: Ray did not start in {START_TRIES} tries:\n" + "\n".join(outputs))

    def python(self, host: Host, module: str, *args: str, timeout: float = START_S) -> dict[str, Any]:
        """Run ``python -m module args`` on ``host``; its last JSON line."""
        out = _check(
            host.run([str(VENV_BIN / "python"), "-m", module, *args], timeout=timeout, env=_auth_env()),
            f"{host.name}: {module}",
        )
        return _json_line(out)

    def view(self) -> dict[str, Any]:
        assert self.head is not None
        return self.python(self.head, "tests.cluster.view")

    def serve_status(self) -> dict[str, Any]:
        assert self.head is not None
        out = self.head.run([str(VENV_BIN / "serve"), "status"], timeout=120, env=_auth_env())
        if out.returncode != 0:
            return {}
        return yaml.safe_load(out.stdout) or {}

    def replicas_running(self) -> int:
        """Running replicas of the app's deployment, as ``serve status`` says (0 while not RUNNING)."""
        app = (self.serve_status().get("applications") or {}).get("triton") or {}
        deployment = (app.get("deployments") or {}).get("TritonDeployment") or {}
        if app.get("status") != "RUNNING" or deployment.get("status") != "HEALTHY":
            return 0
        return int((deployment.get("replica_states") or {}).get("RUNNING", 0))

    def deploy(self, num_replicas: int) -> None:
        """Write the app's config to each host's /tmp and run cluster.yaml's deploy command on the head."""
        assert self.head is not None
        spec = ray_hosts.app_config(num_replicas, MAX_PER_NODE)
        # Every host has the app's config (a cluster's nodes have the synced checkout): the Data job
        # and the probe read its node settings where they run.
        for host in self.ray_hosts():
            host.path(ray_hosts.APP_CONFIG).write_text(yaml.safe_dump(spec))
        command = ray_hosts.deploy_command()
        _check(
            self.head.run(["bash", "-c", command], timeout=START_S, env=_auth_env()),
            f"{self.head.name}: {command}",
        )

    def ray_hosts(self) -> list[Host]:
        return [h for h in [self.head, *self.workers] if h is not None and not h.killed]


def _wait(predicate, timeout_s: float, what: str, poll_s: float = 1.0) -> float:
    """Wait for ``predicate``; the seconds it took. Fails with ``what`` after ``timeout_s``."""
    start = time.monotonic()
    assert wait_for(predicate, timeout_s, poll_s), f"{what}: not within {timeout_s:.0f} s"
    return time.monotonic() - start


def _replicas_by_host(cluster: Cluster) -> dict[str, int]:
    """Serve replica processes per host, counted in each host's own pid namespace."""
    return {h.name: len(h.processes("ServeReplica:triton")) for h in cluster.ray_hosts()}


def _listening(host: Host) -> set[int]:
    """The TCP ports something listens on in ``host``'s network namespace (IPv4 and IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in host.run(["cat", table]).stdout.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _segments(host: Host) -> list[str]:
    return [name for name in host.shm() if name.startswith(SEGMENT_PREFIX)]


def _has_pool(segments: list[str]) -> bool:
    """Whether ``segments`` hold a node pool: its slots (``_node_``) and its slot table (``_slots_``)."""
    return any("_node_" in s for s in segments) and any("_slots_" in s for s in segments)


def _segment_owners_here(host: Host) -> list[str]:
    """The segments of ``host`` whose owner pid (in the name) is not a process of the host."""
    # Pids in a segment's name are the host's own (its pid namespace): /proc inside the host has them.
    strangers = []
    for name in _segments(host):
        owner = name.split("_")[1]
        if not host.path(f"/proc/{owner}").exists():
            strangers.append(name)
    return strangers


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    hosts = Hosts(prefix="rtsh", env=env, cwd=str(REPO))
    hosts.start()
    made = Cluster(hosts)
    try:
        made.head = hosts.add()
        made.workers = [hosts.add(), hosts.add()]
        made.client = hosts.add()
        made.start_ray(made.head, "head")
        for worker in made.workers:
            made.start_ray(worker, "worker")
        _wait(
            lambda: sum(n["alive"] for n in made.view()["nodes"]) == 3,
            START_S,
            "three Ray nodes alive",
            poll_s=2,
        )
        made.node_of = {
            h.name: next(n["id"] for n in made.view()["nodes"] if n["address"] == h.address and n["alive"])
            for h in made.ray_hosts()
        }
        made.deploy(REPLICAS)
        _wait(lambda: made.replicas_running() == REPLICAS, START_S, f"{REPLICAS} replicas running", poll_s=3)
        yield made
    finally:
        for host in hosts:
            if not host.killed:
                host.shm()  # every name it had, for the check below
        try:
            hosts.close()
        finally:
            left = hosts.leftovers()
            in_root = sorted(hosts.seen_in_shm() & set(os.listdir("/dev/shm")))
            assert not left, f"hosts left behind: {left}"
            assert not in_root, f"segments of the hosts in the machine's own /dev/shm: {in_root}"


def test_ray_runs_as_cluster_yaml_starts_it(cluster: Cluster) -> None:
    spec = ray_hosts.cluster_spec()
    head_start = next(c for c in spec["head_start_ray_commands"] if "ray start" in c)
    worker_start = next(c for c in spec["worker_start_ray_commands"] if "ray start" in c)
    # Every flag cluster.yaml gives (but the autoscaler's) is in what ran, and took effect.
    for host, yaml_command in [(cluster.head, head_start)] + [(w, worker_start) for w in cluster.workers]:
        assert host is not None
        (ran,) = [c for c in cluster.commands[host.name] if c.startswith("ray start")]
        for flag in yaml_command.split():
            if flag.startswith("--") and not flag.startswith("--autoscaling-config"):
                assert flag.replace("$RAY_HEAD_IP", cluster.head.address) in ran.split(), (flag, ran)
        assert f"--node-ip-address={host.address}" in ran.split()
        ports = _listening(host)
        assert {8076, 8080} <= ports, (
            f"{host.name}: object manager / metrics ports not listening: {sorted(ports)}"
        )
    assert cluster.head is not None
    assert ray_hosts.GCS_PORT in _listening(cluster.head), "the head's GCS does not listen on 6379"
    # Each node is the host's own address, and the deployed config opens the front door and proxy.
    nodes = {n["address"] for n in cluster.view()["nodes"] if n["alive"]}
    assert nodes == {h.address for h in cluster.ray_hosts()}
    deployed = yaml.safe_load(cluster.head.path(DEPLOYED).read_text())
    assert deployed["http_options"]["host"] == "0.0.0.0"
    assert deployed["applications"][0]["args"]["frontdoor"]["host"] == "0.0.0.0"
    assert deployed["proxy_location"] == "EveryNode"


_ONE_CALL = """
import sys
import numpy as np
from ray_triton_shm._private.cli import soak_caller
for n, address in enumerate(sys.argv[1:]):
    model, inputs, expected = soak_caller.make_request(199, 2 * n + 1)
    outputs = soak_caller.http_caller(address, 60)(model, inputs, list(expected))
    assert soak_caller.check(expected, outputs) is None, (address, soak_caller.check(expected, outputs))
print("ok", len(sys.argv) - 1)
"""


def test_each_host_runs_its_own_node_actor_triton_and_segments(cluster: Cluster) -> None:
    # One request through each host's front door from the client host: its replica takes a slot of
    # its node's pool, so each host's pool segment exists (pools are made on first use).
    assert cluster.client is not None
    doors = [f"{h.address}:{FRONT_HTTP}" for h in cluster.ray_hosts()]
    out = _check(cluster.client.run([str(VENV_BIN / "python"), "-c", _ONE_CALL, *doors]), "one call per host")
    assert out.split() == ["ok", str(len(doors))]
    by_host = _replicas_by_host(cluster)
    assert by_host == {h.name: 1 for h in cluster.ray_hosts()}, f"replicas per host: {by_host}"
    view = cluster.view()
    actors = [a for a in view["node_actors"] if a["state"] == "ALIVE"]
    assert sorted(a["node"] for a in actors) == sorted(cluster.node_of.values()), view["node_actors"]
    listing = {}
    for host in cluster.ray_hosts():
        assert len(host.processes("_NodeActor")) == 1, f"{host.name}: not one node actor"
        assert len(host.processes("bin/tritonserver --model-repository")) == 1, f"{host.name}: not one Triton"
        segments = _segments(host)
        assert _has_pool(segments), f"{host.name}: no pool segment (node, slots) in its /dev/shm: {segments}"
        assert not _segment_owners_here(host), f"{host.name}: segments of processes not on this host"
        listing[host.name] = host.shm()
    names = [set(_segments(h)) for h in cluster.ray_hosts()]
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1 :])
    assert cluster.client is not None
    assert not _segments(cluster.client), "the client host has segments"
    _report("shm_before", listing)


def test_a_client_of_another_hosts_node_actor_fails(cluster: Cluster) -> None:
    here, there = cluster.workers[0], cluster.workers[1]
    result = cluster.python(
        here,
        "tests.cluster.probe",
        "--config",
        ray_hosts.APP_CONFIG,
        "--foreign",
        cluster.node_of[there.name],
    )
    # Its own node's actor: through shared memory, every value right, the Triton of its node.
    assert result["node_id"] == cluster.node_of[here.name]
    assert result["own"] == {
        "path": "shm",
        "correct": True,
        "triton_node_id": cluster.node_of[here.name],
        "http_url": result["own"]["http_url"],
    }
    # Another host's actor: its pool's segments are not in this host's /dev/shm.
    assert result["foreign_info"]["node_id"] == cluster.node_of[there.name]
    assert result["foreign"]["error_type"] == "SharedMemoryError", result
    assert "No such file" in result["foreign"]["error"] or "not found" in result["foreign"]["error"], result
    # And its Triton (on loopback there) is not reachable from here, unless this host's own Triton
    # happens to listen on the same port number (then it answers for itself, not for the other host).
    if result["foreign_info"]["http_url"] != result["own"]["http_url"]:
        assert result["foreign_triton"].startswith(("URLError", "ConnectionRefusedError")), result
    _report("foreign_client", result)


_REPORT: dict[str, Any] = {}


def _report(key: str, value: Any) -> None:
    _REPORT[key] = value
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(_REPORT, indent=1, default=str))


class Callers:
    """The client host's caller processes: one per (target host, protocol), each taking turns over the
    host's front door and Serve proxy of that protocol."""

    def __init__(self, client: Host) -> None:
        self.client = client
        self.procs: dict[str, tuple[subprocess.Popen, int, str, Any]] = {}
        self.next_index = 1

    def start(self, target: Host) -> None:
        for protocol, front, proxy in (("http", FRONT_HTTP, PROXY_HTTP), ("grpc", FRONT_GRPC, PROXY_GRPC)):
            out = f"/tmp/caller-{target.name}-{protocol}.json"
            app = ",triton" if protocol == "grpc" else ""
            argv = [
                str(VENV_BIN / "python"), "-m", "tests.cluster.caller", "--caller", str(self.next_index),
                "--out", out, "--endpoint", f"{protocol},{target.address}:{front}",
                "--endpoint", f"{protocol},{target.address}:{proxy}{app}",
            ]  # fmt: skip
            self.next_index += 1
            log = tempfile.TemporaryFile(mode="w+")
            proc = self.client.popen(argv, stdout=log, stderr=log)
            self.procs[f"{target.name}/{protocol}"] = (proc, self.client.inner_pid(proc), out, log)

    def counts(self) -> dict[str, dict[str, Any]]:
        """Per endpoint (``host/protocol/port``): the latest counts its caller wrote."""
        found = {}
        for key, (_, _, out, _) in self.procs.items():
            path = self.client.path(out)
            if not path.exists():
                continue
            for endpoint in json.loads(path.read_text())["endpoints"]:
                found[f"{key}/{endpoint['url'].rsplit(':', 1)[1]}"] = endpoint
        return found

    def stop(self) -> dict[str, dict[str, Any]]:
        """SIGTERM every caller (the process in the client host, not its nsenter); their last counts."""
        for proc, inner, _, _ in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inner, signal.SIGTERM)
        problems = []
        for key, (proc, inner, _, log) in self.procs.items():
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inner, signal.SIGKILL)
                code = proc.wait(30)
                problems.append(f"caller {key} did not stop on SIGTERM")
            if code != 0:
                problems.append(f"caller {key} exit {code}: {_tail(log, 2000)}")
            log.close()
        assert not problems, problems
        return self.counts()


_COUNTED = ("requests", "correct", "wrong", "errors")


def _tail(stream: Any, chars: int = 4000) -> str:
    stream.seek(0)
    return stream.read()[-chars:]


def _correct(counts: dict[str, dict[str, Any]], prefix: str) -> int:
    return sum(c["correct"] for key, c in counts.items() if key.startswith(prefix))


def _longest_gap(times: list[float], since: float) -> float | None:
    """The longest time without a correct answer from ``since`` to the last one (seconds; None: none)."""
    points = [since, *(t for t in times if t > since)]
    return round(max(b - a for a, b in itertools.pairwise(points)), 1) if len(points) > 1 else None


def _first_correct_after(counts: dict[str, Any], t: float) -> float | None:
    return next((at for at in counts["correct_at"] if at > t), None)


def test_client_host_load_through_a_host_loss_and_a_join(cluster: Cluster) -> None:
    assert cluster.head is not None and cluster.client is not None
    lost = cluster.workers[1]
    survivors = [cluster.head, cluster.workers[0]]
    callers = Callers(cluster.client)
    data = None
    data_pid = 0
    data_out = tempfile.TemporaryFile(mode="w+")
    data_err = tempfile.TemporaryFile(mode="w+")  # Ray's log lines: more than a pipe holds
    try:
        for host in cluster.ray_hosts():
            callers.start(host)
        _wait(
            lambda: len(counts := callers.counts()) == 12 and all(c["correct"] >= 5 for c in counts.values()),
            120,
            "every front door and proxy of hosts 1-3 answering the client host",
        )
        data = cluster.head.popen(
            [str(VENV_BIN / "python"), "-m", "tests.cluster.data_job", "--config", ray_hosts.APP_CONFIG,
             "--rows", str(DATA_ROWS), "--workers", "3", "--batch", "8", "--pause", "0.4"],
            stdout=data_out, stderr=data_err, env=_auth_env(),
        )  # fmt: skip
        data_pid = cluster.head.inner_pid(data)

        # The Data job under way (a first block of rows back) before the host goes.
        def data_progress() -> bool:
            assert data.poll() is None, f"the Data job ended early:\n{_tail(data_out)}\n{_tail(data_err)}"
            return '{"progress"' in _tail(data_out)

        _wait(data_progress, START_S, "the Data job's first rows")
        time.sleep(5)

        # Host 3 is lost: its pid namespace killed as one, its link down.
        lost_node = cluster.node_of[lost.name]
        lost_shm = lost.shm()
        killed_at = time.time()
        lost.kill()
        dead_s = _wait(
            lambda: not any(n["alive"] for n in cluster.view()["nodes"] if n["id"] == lost_node),
            START_S,
            "Ray marks the lost host's node dead",
        )
        replaced_s = _wait(
            lambda: (
                cluster.replicas_running() == REPLICAS
                and sum(_replicas_by_host(cluster).values()) == REPLICAS
            ),
            START_S,
            f"Serve back to {REPLICAS} replicas on the remaining hosts",
            poll_s=2,
        )
        by_host = _replicas_by_host(cluster)
        assert set(by_host) == {h.name for h in survivors} and sum(by_host.values()) == REPLICAS, by_host
        view = cluster.view()
        assert not [a for a in view["node_actors"] if a["node"] == lost_node], view["node_actors"]
        assert not [r for r in view["replicas"] if r["node"] == lost_node], view["replicas"]
        for host in survivors:
            assert not _segment_owners_here(host), f"{host.name}: segments not of its own processes"
            assert not set(_segments(host)) & set(lost_shm)
        # Every survivor endpoint answers correctly after the loss.
        loss_counts = callers.counts()
        since = time.time()
        _wait(
            lambda: all(
                _first_correct_after(c, since) is not None
                for key, c in callers.counts().items()
                if not key.startswith(lost.name)
            ),
            120,
            "every endpoint of hosts 1-2 answering after the loss",
        )
        after_loss = callers.counts()
        recovered = {
            key: round(
                _first_correct_after(c, max([killed_at, *[t for t in c["error_at"] if t > killed_at]]))
                - killed_at,
                1,
            )
            for key, c in after_loss.items()
            if not key.startswith(lost.name) and _first_correct_after(c, killed_at) is not None
        }

        # A new host joins (the next index: 198.18.0.5), and the app grows to a replica more than hosts
        # 1 and 2 may hold (MAX_PER_NODE each): it must start on the new host.
        joined = cluster.hosts.add()
        cluster.workers.append(joined)
        join_at = time.time()
        cluster.start_ray(joined, "worker")
        _wait(
            lambda: any(n["alive"] and n["address"] == joined.address for n in cluster.view()["nodes"]),
            START_S,
            "the new host's node alive",
        )
        node_s = time.time() - join_at
        cluster.node_of[joined.name] = next(
            n["id"] for n in cluster.view()["nodes"] if n["alive"] and n["address"] == joined.address
        )
        assert not joined.processes("tritonserver"), "a Triton on the new host before any replica"
        cluster.deploy(MAX_PER_NODE * len(survivors) + 1)  # one more than hosts 1 and 2 may hold
        _wait(
            lambda: (
                joined.processes("ServeReplica:triton")
                and joined.processes("bin/tritonserver --model-repository")
            ),
            START_S,
            "a replica and its Triton on the new host",
        )
        triton_s = time.time() - join_at
        grown = MAX_PER_NODE * len(survivors) + 1
        _wait(lambda: cluster.replicas_running() == grown, START_S, f"{grown} replicas running", poll_s=2)
        running_s = time.time() - join_at
        callers.start(joined)
        _wait(
            lambda: (
                all(c["correct"] > 0 for key, c in callers.counts().items() if key.startswith(joined.name))
                and len([k for k in callers.counts() if k.startswith(joined.name)]) == 4
            ),
            120,
            "the new host's front door and proxy answering the client host",
        )
        traffic_s = time.time() - join_at
        assert _has_pool(_segments(joined)), f"no pool segment on the new host: {joined.shm()}"
        time.sleep(10)

        # The Data job: every row once, every value right, each worker on its own host's Triton.
        code = data.wait(START_S)
        assert code == 0, f"the Data job failed (exit {code}):\n{_tail(data_out)}\n{_tail(data_err)}"
        job = _json_line(_tail(data_out, 100_000))
    finally:
        final = callers.stop()
        if data is not None and data.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(data_pid, signal.SIGKILL)
            data.wait(30)
        data_out.close()
        data_err.close()

    summary = {
        "calls": {key: {k: c[k] for k in _COUNTED} for key, c in final.items()},
        "wrong": sum(c["wrong"] for c in final.values()),
        "loss": {
            "node_dead_s": round(dead_s, 1),
            "replicas_replaced_s": round(dead_s + replaced_s, 1),
            "first_correct_after_last_error_s": recovered,
            "longest_gap_between_correct_s": {
                key: _longest_gap(c["correct_at"], killed_at)
                for key, c in final.items()
                if key.split("/")[0] in {h.name for h in survivors}
            },
            "lost_host_shm": lost_shm,
            "errors_at_loss": {k: c["errors"] for k, c in loss_counts.items() if c["errors"]},
        },
        "join": {"node_alive_s": round(node_s, 1), "replica_and_triton_s": round(triton_s, 1),
                 "replica_running_s": round(running_s, 1),
                 "traffic_s": round(traffic_s, 1)},
        "replicas_by_host": _replicas_by_host(cluster),
        "ray_start_tries": cluster.start_tries,
        "data_job": job,
        "data_rows_by_host": {
            next((h for h, n in cluster.node_of.items() if n == node), node): rows
            for node, rows in job["per_node"].items()
        },
        "shm_after": {h.name: h.shm() for h in cluster.ray_hosts()},
        "client_shm": cluster.client.shm(),
    }  # fmt: skip
    _report("scenario", summary)
    print(json.dumps(summary, indent=1))

    assert job["returned"] == job["rows"] == DATA_ROWS and job["missing"] == 0 and job["duplicated"] == 0, job
    assert job["wrong"] == 0 and job["foreign_triton"] == 0, job
    assert sum(job["per_node"].values()) == DATA_ROWS

    wrong = {key: c["wrong"] for key, c in final.items() if c["wrong"]}
    assert not wrong, f"wrong answers: {wrong}; samples: {[final[k]['samples'] for k in wrong]}"
    untyped = {
        key: c["errors"] for key, c in final.items() if any(k.startswith("untyped") for k in c["errors"])
    }
    assert not untyped, f"errors not in Triton's shape: {untyped}"
    # The front doors of the hosts that stayed never failed: their replicas use their own host's Triton.
    for host in survivors:
        for protocol, port in (("http", FRONT_HTTP), ("grpc", FRONT_GRPC)):
            c = final[f"{host.name}/{protocol}/{port}"]
            assert c["errors"] == {}, f"{host.name} front door {protocol}: {c['errors']} {c['samples']}"
            assert _first_correct_after(c, killed_at) is not None
    for key, c in final.items():
        assert c["correct"] > 0, f"{key}: no correct answer"


def test_the_head_lost_takes_the_cluster_down_and_the_workers_clean_up(cluster: Cluster) -> None:
    """Out of the scenario's scope (no GCS fault tolerance is configured, as in cluster.yaml): what
    losing the head's processes does (a crash or restart: its address still answers, refusing).
    Measured, and checked only for what must hold: the workers' Ray, replicas, node actors and
    Tritons end, their /dev/shm is left without a segment of ours, no answer is wrong."""
    assert cluster.head is not None and cluster.client is not None
    workers = [w for w in cluster.workers if not w.killed]
    callers = Callers(cluster.client)
    callers.next_index = 150
    callers.start(workers[0])
    _wait(lambda: all(c["correct"] > 0 for c in callers.counts().values()), 120, "the worker answering")
    killed_at = time.time()
    cluster.head.kill(link_down=False)
    gone = {}
    for host in workers:
        _wait(
            lambda host=host: not host.processes("ray/raylet/raylet"),
            START_S,
            f"{host.name}: its raylet ends",
        )
        gone[f"{host.name}_raylet_s"] = round(time.time() - killed_at, 1)
    for host in workers:
        _wait(
            lambda host=host: not host.processes("tritonserver") and not _segments(host),
            START_S,
            f"{host.name}: its Triton and segments gone",
        )
        gone[f"{host.name}_triton_and_segments_s"] = round(time.time() - killed_at, 1)
    final = callers.stop()
    door = final[f"{workers[0].name}/http/{FRONT_HTTP}"]
    last = max(door["correct_at"], default=0.0)
    summary = {
        **gone,
        "front_door_answered_until_s": round(last - killed_at, 1) if last > killed_at else None,
        "calls": {key: {k: c[k] for k in _COUNTED} for key, c in final.items()},
        "shm_after": {h.name: h.shm() for h in workers},
        "left": {h.name: [cmdline(pid)[:120] for pid in h.pids()] for h in workers},
    }
    _report("head_lost", summary)
    print(json.dumps(summary, indent=1))
    assert all(c["wrong"] == 0 for c in final.values()), final
