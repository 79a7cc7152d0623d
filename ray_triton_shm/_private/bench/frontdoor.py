"""The front-door table: every way an external client reaches the Serve app, against Triton's own endpoints.

One run, one Ray, one Triton (the identity model on the native backend and on
the Python backend, see :mod:`~ray_triton_shm._private.bench.servers`), one
Serve app (the front door on; with ``--mode all`` Serve's direct ingress and
HAProxy too). The callers are Triton's own load generator, ``perf_analyzer``
(C++, unchanged, one process per cell whose threads leave the cores to the
servers; see :mod:`.frontdoor_perf`), or with ``--caller tritonclient`` Python
processes outside Ray running unmodified ``tritonclient.http`` or
``tritonclient.grpc`` and checking every output (:mod:`.frontdoor_callers`).
Rows (the ``MB/s`` of all callers together and each path's server CPU per
call; ratios to Triton's own endpoint of the same protocol, same server, size
and callers):

* ``frontdoor-http`` / ``frontdoor-grpc``: the replicas' own listeners on the app's
  ``frontdoor`` ports (what the shipped configs tell clients to use);
* ``serve-http`` / ``serve-grpc``: Serve's proxies (with ``--mode all``, on their fallback ports);
* ``haproxy-http`` / ``haproxy-grpc`` (``--mode all``): HAProxy on the app's ports,
  forwarding to the replicas' direct ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``);
* ``direct-http`` / ``direct-grpc`` (``--mode all``): the replicas' direct-ingress
  ports (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``; perf_analyzer calls the first);
* ``triton-http`` / ``triton-grpc``: Triton's own endpoints on the node.

Run (about 10 minutes for the full table on two cores)::

    python -m ray_triton_shm bench --frontdoor            # perf_analyzer, plain mode, both servers
    python -m ray_triton_shm._private.bench.frontdoor --mode all --caller tritonclient
    python -m ray_triton_shm._private.bench.frontdoor --quick   # 1 MB, native, 8 callers, ours vs Triton
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ray_triton_shm._private.bench import cpu_share
from ray_triton_shm._private.bench.frontdoor_callers import CallerPool
from ray_triton_shm._private.bench.frontdoor_perf import PerfAnalyzerCells, TritonCounter, server_cpu_ms
from ray_triton_shm._private.bench.frontdoor_table import Row, add_ratios, label, make_row, table, targets
from ray_triton_shm._private.bench.servers import SERVERS, build_repository, parse_servers
from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.ingress.kserve_grpc import SERVICER_FUNCTION
from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors
from ray_triton_shm.serve import TritonDeployment, resolve_model_repository

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
    caller: str = "perf_analyzer",
    bytes_per_window: int = 48 * MB,
    min_requests: int = 8,
    windows: int = 3,
    stability_percent: float = 1000.0,
) -> list[Row]:
    """Every cell, rounds rotating the paths; the rows with their ratios and server CPU per call.

    Args:
        paths / servers / sizes / callers: The cells.
        mode: ``plain`` (front door, Serve's proxies) or ``all`` (HAProxy and direct ingress too).
        rounds: Rounds per cell, the paths taking turns in a rotating order.
        duration_s: Time per cell and round of the ``tritonclient`` callers.
        replicas: Replicas of the app.
        caller: ``perf_analyzer`` (Triton's own load generator) or ``tritonclient`` (Python processes).
        bytes_per_window / min_requests / windows / stability_percent: perf_analyzer's
            count windows (see :class:`.PerfAnalyzerCells`).

    Raises:
        PerfAnalyzerMissingError: ``caller`` is perf_analyzer and it is not installed (``make peers``).
    """
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rtshm-frontdoor-") as tmp:
        work = Path(tmp)
        if caller == "perf_analyzer":
            cells_pa = PerfAnalyzerCells(work, bytes_per_window, min_requests, windows, stability_percent)
            pool = None
        else:
            cells_pa, pool = None, CallerPool(max(callers))
        setup = _Setup(mode, servers, max(sizes), replicas, work)
        counter = None
        try:
            setup.start()
            counter = TritonCounter(setup.urls["triton-http"][0])
            for server in servers:
                model = SERVERS[server].identity
                for size in sizes:
                    for n in callers:
                        cells: dict[str, list[Any]] = {p: [] for p in paths}
                        used: dict[str, dict[str, float]] = {
                            p: dict.fromkeys(cpu_share.GROUPS, 0.0) for p in paths
                        }
                        calls = dict.fromkeys(paths, 0)
                        for r in range(rounds):
                            order = list(paths[r % len(paths) :] + paths[: r % len(paths)])
                            for path in order:
                                urls = setup.urls.get(path) or []
                                if not urls:
                                    cells[path].append(None)
                                    continue
                                protocol = path.rsplit("-", 1)[1]
                                before, counted = cpu_share.snapshot(os.getpid()), counter.count(model)
                                if cells_pa is not None:
                                    result = cells_pa.run(protocol, urls, model, size, n)
                                else:
                                    assert pool is not None
                                    result = pool.run(protocol, urls, model, size, n, duration_s)
                                calls[path] += counter.count(model) - counted
                                spent = cpu_share.cpu_by_group(
                                    before, cpu_share.snapshot(os.getpid()), pool.pids if pool else ()
                                )
                                spent["callers"] += getattr(result, "cpu_s", 0.0)  # perf_analyzer, exited
                                for group, seconds in spent.items():
                                    used[path][group] += seconds
                                cells[path].append(result)
                                print(
                                    f"  {server:<6} {label(size):>6} x{n} {path:<15} "
                                    + (
                                        f"{result.mb_s:8.1f} MB/s  p50 {result.p50_ms:7.2f} ms"
                                        if result.error is None
                                        else f"FAILED {result.error}"
                                    ),
                                    flush=True,
                                )
                        for path in paths:
                            row = make_row(path, server, size, n, cells[path])
                            row.calls = calls[path]
                            if calls[path] and not row.error:
                                row.cpu_ms = {g: 1e3 * used[path][g] / calls[path] for g in cpu_share.GROUPS}
                                row.server_cpu_ms = server_cpu_ms(path, used[path], calls[path])
                            rows.append(row)
        finally:
            if counter is not None:
                counter.close()
            if pool is not None:
                pool.close()
            setup.stop()
    add_ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode", choices=("all", "plain"), default="plain", help="all: HAProxy and direct ingress too"
    )
    parser.add_argument(
        "--caller",
        choices=("perf_analyzer", "tritonclient"),
        default="perf_analyzer",
        help="perf_analyzer (Triton's own, C++) or tritonclient processes (Python)",
    )
    parser.add_argument("--servers", default="native,python")
    parser.add_argument("--sizes", default="1M,16M")
    parser.add_argument("--callers", default="1,8")
    parser.add_argument("--paths", default=None, help="comma-separated subset of the rows")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--mb-per-window", type=int, default=48, help="perf_analyzer: payload MB per count window"
    )
    parser.add_argument(
        "--min-requests", type=int, default=8, help="perf_analyzer: requests per window at least"
    )
    parser.add_argument("--windows", type=int, default=3, help="perf_analyzer: count windows at most (-r)")
    parser.add_argument(
        "--stability-percent",
        type=float,
        default=1000.0,
        help="perf_analyzer's stability test (-s; the default turns it off: rounds show the spread)",
    )
    parser.add_argument("--duration-s", type=float, default=3.0, help="tritonclient: time per cell and round")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the app (as the shipped config)")
    parser.add_argument(
        "--quick", action="store_true", help="1 MB, native, 8 callers, one round: ours vs Triton's own"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--out", default=None, help="also write frontdoor.md and frontdoor.json here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if args.quick:
        args.mode, args.servers, args.sizes, args.callers = "plain", "native", "1M", "8"
        args.paths = args.paths or ",".join(QUICK_PATHS)
        args.rounds, args.mb_per_window, args.duration_s = 1, 24, 1.0
    default_paths = ALL_PATHS if args.mode == "all" else PLAIN_PATHS
    paths = tuple(p.strip() for p in args.paths.split(",")) if args.paths else default_paths
    unknown = [p for p in paths if p not in ALL_PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {list(ALL_PATHS)}")
    began = time.monotonic()
    rows = measure(
        paths,
        parse_servers(args.servers),
        tuple(_size(s) for s in args.sizes.split(",")),
        tuple(int(c) for c in args.callers.split(",")),
        mode=args.mode,
        rounds=args.rounds,
        duration_s=args.duration_s,
        replicas=args.replicas,
        caller=args.caller,
        bytes_per_window=args.mb_per_window * MB,
        min_requests=args.min_requests,
        windows=args.windows,
        stability_percent=args.stability_percent,
    )
    text = "\n".join([table(rows), "", *targets(rows)])
    print()
    print(text)
    info = _info(argv if argv is not None else sys.argv[1:], args.caller, time.monotonic() - began)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1, default=str)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "frontdoor.json").write_text(
            json.dumps({"info": info, "rows": [r.__dict__ for r in rows]}, indent=1, default=str) + "\n"
        )
        (out / "frontdoor.md").write_text(_markdown(info, text))
        print(f"wrote {out / 'frontdoor.md'} and {out / 'frontdoor.json'}")
    failed = [r for r in rows if r.error and r.error != "not available in this mode"]
    return 1 if failed else 0


def _info(argv: list[str], caller: str, seconds: float) -> dict[str, Any]:
    """The run's command, machine and load, for the report."""
    cpu = "?"
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            "?",
        )
    return {
        "command": "python -m ray_triton_shm._private.bench.frontdoor " + " ".join(argv),
        "caller": caller,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu}",
        "ray": ray.__version__,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "duration_s": round(seconds, 1),
    }


def _markdown(info: dict[str, Any], text: str) -> str:
    head = "\n".join(f"- {key}: `{value}`" for key, value in info.items())
    return f"## The front-door table ({info['caller']})\n\n{head}\n\n{text}\n"


if __name__ == "__main__":
    sys.exit(main())
