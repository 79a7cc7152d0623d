"""The front-door table: every way an external client reaches the Serve app, against Triton's own endpoints.

One run, one Ray, one Triton (the identity model on the native backend and on
the Python backend, see :mod:`~ray_triton_shm._private.bench.servers`), one
Serve app (the front door on; with ``--mode all`` Serve's direct ingress and
HAProxy too). Each caller is a process of its own outside Ray running
unmodified ``tritonclient.http`` or ``tritonclient.grpc`` and checking every
output. Rows (the ``MB/s`` of all callers together; ratio to Triton's own
endpoint of the same protocol, same server, size and callers):

* ``frontdoor-http`` / ``frontdoor-grpc``: the replicas' own listeners on the app's
  ``frontdoor`` ports (what the shipped configs tell clients to use);
* ``serve-http`` / ``serve-grpc``: Serve's proxies (with ``--mode all``, on their fallback ports);
* ``haproxy-http`` / ``haproxy-grpc`` (``--mode all``): HAProxy on the app's ports,
  forwarding to the replicas' direct ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``);
* ``direct-http`` / ``direct-grpc`` (``--mode all``): the replicas' direct-ingress
  ports (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``), callers spread over the replicas;
* ``triton-http`` / ``triton-grpc``: Triton's own endpoints on the node.

Run (about 10 minutes for the full table on two cores)::

    python -m ray_triton_shm bench --frontdoor
    python -m ray_triton_shm._private.bench.frontdoor --mode all --sizes 1M,16M --callers 1,8
    python -m ray_triton_shm._private.bench.frontdoor --quick   # 1 MB, native, 8 callers, ours vs Triton
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ray_triton_shm._private.bench import cpu_share
from ray_triton_shm._private.bench.frontdoor_callers import CallerPool
from ray_triton_shm._private.bench.servers import SERVERS, build_repository, parse_servers
from ray_triton_shm._private.serve.door.frontdoor import FrontDoorConfig
from ray_triton_shm._private.serve.ingress.kserve_grpc import SERVICER_FUNCTION
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors
from ray_triton_shm.serve import TritonDeployment, resolve_model_repository
from ray_triton_shm.server import free_ports

logger = logging.getLogger(__name__)

KB = 1024
MB = 1024 * KB
ALL_PATHS = (
    "frontdoor-http",
    "serve-http",
    "haproxy-http",
    "direct-http",
    "triton-http",
    "frontdoor-grpc",
    "serve-grpc",
    "haproxy-grpc",
    "direct-grpc",
    "triton-grpc",
)
PLAIN_PATHS = ("frontdoor-http", "serve-http", "triton-http", "frontdoor-grpc", "serve-grpc", "triton-grpc")
QUICK_PATHS = ("frontdoor-http", "triton-http", "frontdoor-grpc", "triton-grpc")

TARGETS = (
    # (path, server, size, callers, minimum ratio to Triton's own endpoint of the same protocol)
    ("frontdoor-http", "native", 1 * MB, 8, 1.0),
    ("frontdoor-http", "native", 16 * MB, 8, 1.5),
    ("frontdoor-grpc", "native", 1 * MB, 8, 1.0),
    ("frontdoor-grpc", "native", 16 * MB, 8, 1.0),
)
"""The front door's targets (native server, 8 callers); on the Python server every row of ours >= 1.0x."""


@dataclass
class Row:
    """One cell of the table (the median of its rounds)."""

    path: str
    server: str
    size: int
    callers: int
    mb_s: float
    p50_ms: float
    rounds: list[float] = field(default_factory=list)
    error: str | None = None
    ratio: float = float("nan")
    cpu_ms: dict[str, float] = field(default_factory=dict)
    """CPU milliseconds per call by process group (with ``--cpu``; see :mod:`.cpu_share`)."""


def _free_range(width: int) -> int:
    """The start of ``width`` consecutive ports nothing listens on (best effort)."""
    for _ in range(50):
        base = random.randrange(20000, 29000 - width)
        if not any(_listening(base + i) for i in range(width)):
            return base
    raise RuntimeError("no free port range found")


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": KB, "M": MB}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def _label(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


class _Setup:
    """The run's Ray, Triton and Serve app, and the URL of every path."""

    def __init__(self, mode: str, servers: tuple[str, ...], max_size: int, replicas: int, work: Path) -> None:
        self.mode = mode
        self.servers = servers
        self.max_size = max_size
        self.replicas = replicas
        self.work = work
        self.urls: dict[str, list[str]] = {}
        self._cleanup: list[Path] = []

    def start(self) -> None:

        repo = build_repository(
            self.servers, str(resolve_model_repository("examples")), None, self.work / "models"
        )
        n = self.max_size // 4
        pool = PoolConfig(slots=8, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
        node_config = NodeConfig(
            server=ServerConfig(model_repository=str(repo)),
            pools={SERVERS[s].identity: pool for s in self.servers},
            idle_shutdown_s=5,
        )
        # Every port at once: chosen one by one, the kernel may hand one out twice.
        serve_http, serve_grpc, fd_http, fd_grpc, fallback_http, fallback_grpc, stats, metrics = free_ports(
            "127.0.0.1", 8
        )
        if self.mode == "all":
            base = _free_range(200)
            # HAProxy's socket path (under a directory named after the node) must stay under 97 bytes.
            haproxy_dir = Path(tempfile.mkdtemp(prefix="hp", dir="/tmp"))
            self._cleanup.append(haproxy_dir)
            os.environ.update(
                {
                    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                    "RAY_SERVE_ENABLE_HA_PROXY": "1",
                    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(base),
                    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(base + 99),
                    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(base + 100),
                    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(base + 199),
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
                    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
                    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy_dir / "haproxy.cfg"),
                    "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy_dir / "admin.sock"),
                    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy_dir),
                    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy_dir / "server-state"),
                    "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
                    "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
                }
            )
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        serve.start(
            http_options={"host": "127.0.0.1", "port": serve_http},
            grpc_options={"port": serve_grpc, "grpc_servicer_functions": [SERVICER_FUNCTION]},
        )
        frontdoor = FrontDoorConfig(http_port=fd_http, grpc_port=fd_grpc)
        serve.run(
            TritonDeployment.options(num_replicas=self.replicas).bind(node_config, None, "system", frontdoor),
            name="triton",
            route_prefix="/",
        )
        actor = next(iter(ensure_node_actors(node_config).values()))
        self.urls = {
            "frontdoor-http": [f"127.0.0.1:{fd_http}"],
            "frontdoor-grpc": [f"127.0.0.1:{fd_grpc}"],
            "triton-http": [actor.http_url],
            "triton-grpc": [actor.grpc_url],
        }
        if self.mode == "all":
            self.urls["serve-http"] = [f"127.0.0.1:{fallback_http}"]
            self.urls["serve-grpc"] = [f"127.0.0.1:{fallback_grpc}"]
            self.urls["haproxy-http"] = [f"127.0.0.1:{serve_http}"]
            self.urls["haproxy-grpc"] = [f"127.0.0.1:{serve_grpc}"]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                http = [f"127.0.0.1:{p}" for p in range(base, base + 100) if _listening(p)]
                grpc_ = [f"127.0.0.1:{p}" for p in range(base + 100, base + 200) if _listening(p)]
                if len(http) >= self.replicas and len(grpc_) >= self.replicas and _listening(serve_http):
                    break
                time.sleep(1)
            self.urls["direct-http"], self.urls["direct-grpc"] = http, grpc_
        else:
            self.urls["serve-http"] = [f"127.0.0.1:{serve_http}"]
            self.urls["serve-grpc"] = [f"127.0.0.1:{serve_grpc}"]

    def stop(self) -> None:

        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            shutdown_node_actors()
        ray.shutdown()
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)


def measure(
    paths: tuple[str, ...],
    servers: tuple[str, ...],
    sizes: tuple[int, ...],
    callers: tuple[int, ...],
    *,
    mode: str,
    rounds: int,
    duration_s: float,
    replicas: int,
    cpu: bool = False,
) -> list[Row]:
    """Every cell, rounds rotating the paths; the rows with their ratios (and CPU per call with ``cpu``)."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rtshm-frontdoor-") as tmp:
        setup = _Setup(mode, servers, max(sizes), replicas, Path(tmp))
        pool = CallerPool(max(callers))
        try:
            setup.start()
            for server in servers:
                model = SERVERS[server].identity
                for size in sizes:
                    for n in callers:
                        cells: dict[str, list[Any]] = {p: [] for p in paths}
                        used: dict[str, dict[str, float]] = {p: {} for p in paths}
                        for r in range(rounds):
                            order = list(paths[r % len(paths) :] + paths[: r % len(paths)])
                            for path in order:
                                urls = setup.urls.get(path) or []
                                if not urls:
                                    cells[path].append(None)
                                    continue
                                protocol = path.rsplit("-", 1)[1]
                                before = cpu_share.snapshot() if cpu else {}
                                result = pool.run(protocol, urls, model, size, n, duration_s)
                                if cpu:
                                    spent = cpu_share.cpu_by_group(before, cpu_share.snapshot(), pool.pids)
                                    for group, seconds in spent.items():
                                        used[path][group] = used[path].get(group, 0.0) + seconds
                                cells[path].append(result)
                                print(
                                    f"  {server:<6} {_label(size):>6} x{n} {path:<15} "
                                    + (
                                        f"{result.mb_s:8.1f} MB/s  p50 {result.p50_ms:7.2f} ms"
                                        if result.error is None
                                        else f"FAILED {result.error}"
                                    ),
                                    flush=True,
                                )
                        for path in paths:
                            row = _row(path, server, size, n, cells[path])
                            calls = sum(r.calls for r in cells[path] if r is not None)
                            if used[path] and calls:
                                row.cpu_ms = {g: 1e3 * used[path][g] / calls for g in cpu_share.GROUPS}
                            rows.append(row)
        finally:
            pool.close()
            setup.stop()
    _ratios(rows)
    return rows


def _row(path: str, server: str, size: int, n: int, results: list[Any]) -> Row:
    good = [r for r in results if r is not None and r.error is None and r.calls]
    if not good:
        errors = [r.error for r in results if r is not None and r.error]
        nan = float("nan")
        return Row(
            path, server, size, n, nan, nan, error=errors[0] if errors else "not available in this mode"
        )
    return Row(
        path,
        server,
        size,
        n,
        statistics.median(r.mb_s for r in good),
        statistics.median(r.p50_ms for r in good),
        rounds=[round(r.mb_s, 1) for r in good],
    )


def _ratios(rows: list[Row]) -> None:
    base = {(r.path, r.server, r.size, r.callers): r.mb_s for r in rows}
    for row in rows:
        protocol = row.path.rsplit("-", 1)[1]
        triton = base.get((f"triton-{protocol}", row.server, row.size, row.callers), float("nan"))
        row.ratio = row.mb_s / triton if triton and not math.isnan(triton) else float("nan")


def targets(rows: list[Row]) -> list[str]:
    """The targets' lines: met / NOT met, with the numbers."""
    by_key = {(r.path, r.server, r.size, r.callers): r for r in rows}
    lines = []
    for path, server, size, n, minimum in TARGETS:
        row = by_key.get((path, server, size, n))
        if row is None:
            continue
        verdict = "met" if row.ratio >= minimum else "NOT met"
        lines.append(
            f"{path} {server} {_label(size)} x{n}: {row.ratio:.2f}x Triton's own"
            f" ({row.mb_s:.0f} vs {row.mb_s / row.ratio if row.ratio else float('nan'):.0f} MB/s),"
            f" target >= {minimum:.1f}x: {verdict}"
        )
    ours = [r for r in rows if r.server == "python" and r.path.startswith("frontdoor-") and not r.error]
    if ours:
        low = [r for r in ours if r.ratio < 1.0]
        lines.append(
            "python server, every front-door row >= 1.0x Triton's own: "
            + ("met" if not low else "NOT met (" + ", ".join(_cell(r) for r in low) + ")")
        )
    return lines


def _cell(row: Row) -> str:
    return f"{row.path} {_label(row.size)} x{row.callers} {row.ratio:.2f}x"


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (MB/s, p50 ms, ratio to Triton's own endpoint of the protocol)."""
    with_cpu = any(r.cpu_ms for r in rows)
    cpu_head = " CPU ms per call: callers / replicas / Triton / rest |" if with_cpu else ""
    lines = [
        "| server | path | payload | callers | MB/s | p50 ms | vs Triton's own | rounds MB/s |" + cpu_head,
        "|---|---|---|---|---|---|---|---|" + ("---|" if with_cpu else ""),
    ]
    for r in rows:
        if r.error:
            lines.append(
                f"| {r.server} | {r.path} | {_label(r.size)} | {r.callers} | - | - | - | {r.error} |"
            )
            continue
        lines.append(
            f"| {r.server} | {r.path} | {_label(r.size)} | {r.callers} | {r.mb_s:.0f} | {r.p50_ms:.1f}"
            f" | {r.ratio:.2f}x | {', '.join(str(x) for x in r.rounds)} |"
            + (f" {' / '.join(f'{r.cpu_ms[g]:.2f}' for g in cpu_share.GROUPS)} |" if r.cpu_ms else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode", choices=("all", "plain"), default="all", help="all: HAProxy and direct ingress too"
    )
    parser.add_argument("--servers", default="native,python")
    parser.add_argument("--sizes", default="1M,16M")
    parser.add_argument("--callers", default="1,8")
    parser.add_argument("--paths", default=None, help="comma-separated subset of the rows")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=3.0, help="time per cell and round")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the app (as the shipped config)")
    parser.add_argument("--quick", action="store_true", help="1 MB, native, 8 callers, ours vs Triton's own")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--cpu", action="store_true", help="CPU ms per call of the callers, replicas, Triton and the rest"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if args.quick:
        args.mode, args.servers, args.sizes, args.callers = "plain", "native", "1M", "8"
        args.paths = args.paths or ",".join(QUICK_PATHS)
    default_paths = ALL_PATHS if args.mode == "all" else PLAIN_PATHS
    paths = tuple(p.strip() for p in args.paths.split(",")) if args.paths else default_paths
    unknown = [p for p in paths if p not in ALL_PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {list(ALL_PATHS)}")
    rows = measure(
        paths,
        parse_servers(args.servers),
        tuple(_size(s) for s in args.sizes.split(",")),
        tuple(int(c) for c in args.callers.split(",")),
        mode=args.mode,
        rounds=args.rounds,
        duration_s=args.duration_s,
        replicas=args.replicas,
        cpu=args.cpu,
    )
    print()
    print(table(rows))
    print()
    for line in targets(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
