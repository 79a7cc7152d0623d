"""The attack table: every attack against the front door and against Triton's own ports of the same node.

One run: a local Ray, the shipped Serve config (``deployments/triton_shm.yaml``:
two replicas, the front door on; every port moved to a free one), the node's
Triton. For each server in turn, legitimate HTTP and gRPC callers (processes
running tritonclient) call ``identity`` on that server throughout, and each
attack is judged (:mod:`.judge`): the front door's memory is its replicas',
Triton's its own process's. Attack traffic goes to 127.0.0.1 only. Writes
``attacks.json`` and ``attacks.md`` under ``--out``. Run (about 10 minutes on
two cores)::

    python -m ray_triton_shm bench --attacks
    python -m ray_triton_shm._private.bench.attacks.table --only grpc-reset-calls,http-cl-and-te
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

from ray_triton_shm._private.bench.attacks import ATTACKS, BY_NAME
from ray_triton_shm._private.bench.attacks.catalog import Attack
from ray_triton_shm._private.bench.attacks.judge import Bounds, Verdict, judge, listening_pids
from ray_triton_shm._private.bench.attacks.legit import LegitCallers
from ray_triton_shm._private.bench.attacks.wire import Target
from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.node import shutdown_node_actors
from ray_triton_shm.serve import run_config_file

logger = logging.getLogger(__name__)
SHIPPED = Path("deployments") / "triton_shm.yaml"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Servers:
    """The app's two servers on one node: the front door and Triton's own ports, and their processes."""

    frontdoor: Target
    triton: Target
    replica_pids: tuple[int, ...]
    triton_pid: int

    def pids(self, target: Target) -> list[int]:
        """The processes whose memory counts for ``target``."""
        return list(self.replica_pids) if target.name == "frontdoor" else [self.triton_pid]


def on_free_ports(spec: dict[str, Any], frontdoor: dict[str, Any] | None = None) -> dict[str, Any]:
    """``spec`` (a Serve config) with Serve's ports and the front door's on free ones (``frontdoor``:
    more front-door settings); returns ``spec``."""
    http, grpc_, door_http, door_grpc = free_ports("127.0.0.1", 4)
    spec["http_options"]["port"] = http
    if "grpc_options" in spec:
        spec["grpc_options"]["port"] = grpc_
    args = spec["applications"][0]["args"]
    args["frontdoor"] = {
        **args["frontdoor"],
        "http_port": door_http,
        "grpc_port": door_grpc,
        **(frontdoor or {}),
    }
    return spec


def servers_of(handle: Any, frontdoor: dict[str, Any], replicas: int, timeout_s: float = 60.0) -> Servers:
    """The :class:`Servers` of a running app (``handle``; its ``frontdoor`` args) once ``replicas``
    processes listen on its front door.

    Raises:
        TimeoutError: Fewer replicas listen after ``timeout_s``.
    """
    where = handle.whereami.remote().result()
    deadline = time.monotonic() + timeout_s
    while len(pids := listening_pids(frontdoor["http_port"])) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {replicas} replicas listen on the front door")
        time.sleep(0.5)
    triton_http, triton_grpc = where["http_url"], where["grpc_url"]
    return Servers(
        frontdoor=Target(
            name="frontdoor",
            host="127.0.0.1",
            http_port=frontdoor["http_port"],
            grpc_port=frontdoor["grpc_port"],
            stats_url=triton_http,
        ),
        triton=Target(
            name="triton",
            host="127.0.0.1",
            http_port=int(triton_http.rsplit(":", 1)[1]),
            grpc_port=int(triton_grpc.rsplit(":", 1)[1]),
            stats_url=triton_http,
        ),
        replica_pids=tuple(pids),
        triton_pid=int(where["triton_pid"]),
    )


@contextlib.contextmanager
def shipped_app(config: Path) -> Iterator[Servers]:
    """A local Ray running the Serve config file ``config`` on free ports; its servers."""
    spec = on_free_ports(yaml.safe_load(config.read_text()))
    replicas = sum(d.get("num_replicas", 1) for d in spec["applications"][0].get("deployments", [{}]))
    with tempfile.TemporaryDirectory(prefix="rtshm-attacks-") as tmp:
        path = Path(tmp) / config.name
        path.write_text(yaml.safe_dump(spec))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            handles = run_config_file(str(path))
            handle = handles[spec["applications"][0]["name"]]
            yield servers_of(handle, spec["applications"][0]["args"]["frontdoor"], replicas)
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            with contextlib.suppress(Exception):
                shutdown_node_actors()
            ray.shutdown()


def run_all(
    servers: Servers, attacks: tuple[Attack, ...], bounds: Bounds, targets: tuple[str, ...]
) -> list[Verdict]:
    """Every attack on each target in turn (legitimate callers on that target throughout)."""
    verdicts = []
    for name in targets:
        target = getattr(servers, name)
        with LegitCallers(target.http_url, target.grpc_url) as callers:
            for attack in attacks:
                verdict = judge(attack, target, callers, servers.pids(target), bounds)
                print(f"  {name:<9} {attack.name:<30} {cell(verdict)}", flush=True)
                verdicts.append(verdict)
    return verdicts


def cell(v: Verdict) -> str:
    """A verdict in a few words: held or **broke**, and its numbers."""
    if v.kind == "protocol":
        answer = f"({v.notes.get('answer')})"
        if v.held:
            return f"refused {answer}"
        if v.notes.get("refused"):  # refused, but the legitimate callers suffered
            return f"refused {answer}, **broke**: " + "; ".join(v.reasons)
        return f"**accepted** {answer}"
    gaps = ", ".join(f"{p.replace('grpc', 'gRPC')} {gap:.1f} s" for p, gap in v.gaps_s.items())
    numbers = f"longest gap {gaps} (quiet {v.baseline_gap_s:.1f} s), {v.calls} calls"
    numbers += f", RSS +{v.rss_growth_mib:.0f} MiB"
    if "ran" in v.notes:
        numbers = f"ran {v.notes['ran']} of {v.notes['calls reset']}, " + numbers
    if v.held:
        return f"held: {numbers}"
    return "**broke**: " + "; ".join(v.reasons) + f" ({numbers})"


def markdown(verdicts: list[Verdict]) -> str:
    """The side-by-side table (one row an attack)."""
    by = {(v.attack, v.target): v for v in verdicts}
    lines = [
        "| attack | class | what | front door | Triton's own |",
        "|---|---|---|---|---|",
    ]
    for attack in dict.fromkeys(v.attack for v in verdicts):
        a = BY_NAME[attack]
        cells = [cell(by[(attack, t)]) if (attack, t) in by else "-" for t in ("frontdoor", "triton")]
        lines.append(f"| `{attack}` | {a.kind} | {a.summary} | {cells[0]} | {cells[1]} |")
    held = {t: sum(v.held for v in verdicts if v.target == t) for t in ("frontdoor", "triton")}
    total = {t: sum(1 for v in verdicts if v.target == t) for t in ("frontdoor", "triton")}
    lines.append("")
    lines.append(
        f"Held: front door {held['frontdoor']} of {total['frontdoor']}, Triton's own {held['triton']} of "
        f"{total['triton']}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=str(SHIPPED), help="the Serve config file (default: the shipped one)"
    )
    parser.add_argument("--only", default=None, help="comma-separated attack names (default: all)")
    parser.add_argument("--targets", default="frontdoor,triton", help="frontdoor, triton or both")
    parser.add_argument("--hold-s", type=float, default=Bounds.hold_s, help="how long each attack lasts")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies each attack's counts")
    parser.add_argument("--out", default="bench-results", help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = [n.strip() for n in args.only.split(",")] if args.only else [a.name for a in ATTACKS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {list(BY_NAME)}")
    targets = tuple(t.strip() for t in args.targets.split(","))
    if set(targets) - {"frontdoor", "triton"}:
        parser.error("--targets: frontdoor, triton or both")
    bounds = Bounds(hold_s=args.hold_s, scale=args.scale)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with shipped_app(Path(args.config)) as servers:
        verdicts = run_all(servers, tuple(BY_NAME[n] for n in names), bounds, targets)
    text = markdown(verdicts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.node()}, {platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}"
    (out / "attacks.json").write_text(
        json.dumps(
            {
                "started": started,
                "machine": machine,
                "bounds": dataclasses.asdict(bounds),
                "verdicts": [dataclasses.asdict(v) for v in verdicts],
            },
            indent=1,
            default=str,
        )
    )
    header = f"`python -m ray_triton_shm bench --attacks`, {started}, {machine}.\n\n"
    (out / "attacks.md").write_text(header + text + "\n")
    print()
    print(text)
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
