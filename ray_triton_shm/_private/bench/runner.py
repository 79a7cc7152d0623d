"""The benchmark run: one Triton, two servers' models, every method, every size and caller count.

Flow: build the run's model repository (the native C backend's identity and
multi_io, and the Python backend's, see :mod:`.servers`), start Ray and the node
actor on it (or, with ``ray=False``, a plain
:class:`~ray_triton_shm.server.TritonServer`), then per server: every core
method on its identity, the per-request profile, the Serve and Data methods;
and write ``results.json``, the plots and ``report.md``. What to run and the
records are in :mod:`.options`, the timed cells in :mod:`.cells`, the Ray rows in
:mod:`.ray_rows`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from ray_triton_shm._private.bench import core_methods, profile, report
from ray_triton_shm._private.bench.cells import run_group, tagged
from ray_triton_shm._private.bench.core_methods import CORE_METHODS, Endpoints, make_inputs
from ray_triton_shm._private.bench.options import (
    DATA_METHODS,
    MAX_BYTES_IN_FLIGHT,
    MB,
    SERVE_METHODS,
    BenchOptions,
    Record,
)
from ray_triton_shm._private.bench.servers import SERVERS, BenchServer, build_repository
from ray_triton_shm._private.bench.timing import Progress
from ray_triton_shm._private.triton.repository import examples_repository
from ray_triton_shm.config import PoolConfig, ServerConfig
from ray_triton_shm.server import TritonServer

logger = logging.getLogger(__name__)


def _model_repository(options: BenchOptions) -> str:
    return os.path.abspath(options.model_repository or examples_repository())


def _identity_pool(max_bytes: int, slots: int) -> Any:
    n = max(1, max_bytes // 4)
    return PoolConfig(slots=slots, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})


@contextlib.contextmanager
def _triton(options: BenchOptions) -> Iterator[tuple[Endpoints, dict[str, Any], Any]]:
    """The run's one Triton on the run's repository: the node actor's under Ray, else a plain server."""
    with tempfile.TemporaryDirectory(prefix="rtshm-bench-models-") as scratch:
        repository = str(
            build_repository(
                options.servers or tuple(SERVERS),
                _model_repository(options),
                options.native_repository,
                Path(scratch) / "models",
            )
        )
        with _triton_on(options, repository) as triton:
            yield triton


@contextlib.contextmanager
def _triton_on(options: BenchOptions, repository: str) -> Iterator[tuple[Endpoints, dict[str, Any], Any]]:
    if not options.ray:
        with TritonServer(ServerConfig(model_repository=repository)) as server:
            info = {"triton": server.version, "triton_source": server.binary_source}
            yield Endpoints(server.grpc_url, server.http_url), info, None
        return
    # lazy: Ray loads only when it runs (`bench --no-ray` runs without it)
    import ray
    from ray import serve

    from ray_triton_shm._private.bench import ray_rows
    from ray_triton_shm._private.node.node_lifecycle import attach
    from ray_triton_shm.node import NodeConfig, shutdown_node_actors

    serve_max = max(options.serve_sizes or (MB,))
    node_config = NodeConfig(
        # The core methods (and triton-shm-client) register their own regions on the node
        # actor's Triton, so its shm endpoints stay open here: loopback only, one user.
        server=ServerConfig(model_repository=repository, protect_shm_api=False),
        pools={SERVERS[name].identity: _identity_pool(serve_max, 8) for name in options.servers or ()},
    )
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    ray_rows.quiet_ray()
    try:
        # The run is a user of the node's Triton for its whole length: the core cells talk to
        # Triton straight, and an actor nobody attached to goes away after idle_shutdown_s.
        _, node = attach(node_config, f"bench-{os.getpid()}", os.getpid(), "client")
        info = {"triton": node.version, "ray": ray.__version__}
        yield Endpoints(node.grpc_url, node.http_url), info, node_config
    finally:
        try:
            serve.shutdown()
        finally:
            shutdown_node_actors()
            ray.shutdown()


def core_plan(options: BenchOptions) -> list[tuple[str, int, int]]:
    """(method, size, concurrency) cells of the core part, skipping those too big for memory."""
    plan = []
    for size in options.sizes or ():
        for concurrency in options.concurrency or ():
            if size * concurrency > MAX_BYTES_IN_FLIGHT:
                continue
            plan.extend((method, size, concurrency) for method in options.methods or ())
    return plan


def run_bench(options: BenchOptions, write: Callable[[str], None] = print) -> list[Record]:
    """Run the benchmark and write its outputs under ``options.out_dir``.

    Args:
        options: What to run.
        write: Where the report text goes (the CLI prints it).

    Returns:
        Every record measured (failed cells have ``ok=False``).
    """
    options = options.resolved()
    began = time.monotonic()
    records: list[Record] = []
    methods = list(options.methods or ())
    if "triton-shm-client" in methods and core_methods.import_competitor() is None:
        write("triton-shm-client is not installed: skipping it (make bench installs it)")
        methods.remove("triton-shm-client")
        options = BenchOptions(**{**asdict(options), "methods": tuple(methods)})
    plan = core_plan(options)
    rounds = options.rounds or 1
    servers = [SERVERS[name] for name in options.servers or ()]
    ray_cells = 0
    if options.ray:
        serve_methods = len(options.serve_methods or SERVE_METHODS)
        serve_cells = serve_methods * len(options.serve_sizes or ()) * len(options.serve_concurrency or ())
        app_cells = 2 * len(options.serve_concurrency or ())
        ray_cells = serve_cells + (0 if options.serve_methods else app_cells + len(DATA_METHODS))
    progress = Progress((len(plan) + ray_cells) * rounds * len(servers), enabled=options.progress)
    profiles: list[dict[str, Any]] = []
    with _triton(options) as (run_endpoints, info, node_config):
        groups: dict[tuple[int, int], list[str]] = {}
        for method, size, concurrency in plan:
            groups.setdefault((size, concurrency), []).append(method)
        for server in servers:
            endpoints = dataclasses.replace(run_endpoints, model=server.identity)
            for (size, concurrency), group_methods in groups.items():
                inputs = make_inputs(size, concurrency)
                openers = [
                    (method, lambda f=CORE_METHODS[method], i=inputs, e=endpoints: f(e, i))
                    for method in group_methods
                ]
                group = run_group(openers, size, concurrency, options, "core", progress)
                records.extend(tagged(group, server))
                del inputs, openers
            if options.profile:
                progress.step(f"profiling requests on the {server.name} server")
                profiles.extend(_profile(options, endpoints, server))
            if options.ray:
                from ray_triton_shm._private.bench import ray_rows  # lazy: loads Ray

                records.extend(
                    tagged(ray_rows.run_ray(options, endpoints, node_config, progress, server), server)
                )
    progress.close()
    info.update(_environment())
    info["duration_s"] = round(time.monotonic() - began, 1)
    info["quick"] = options.quick
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {"info": info, "records": [asdict(r) for r in records], "profile": profiles},
            indent=1,
            allow_nan=True,
        )
        + "\n"
    )
    text = report.render(records, info, profiles)
    plots = report.plot(records, out) if options.plots else []
    (out / "report.md").write_text(report.markdown(records, info, plots, profiles))
    write(text)
    write(
        f"wrote {out / 'results.json'}, {out / 'report.md'}" + (f" and {len(plots)} plots" if plots else "")
    )
    return records


def _profile(options: BenchOptions, endpoints: Endpoints, server: BenchServer) -> list[dict[str, Any]]:
    """Where a request's time goes on ``server``: see :func:`profile.profile_requests`."""
    sizes = [s for s in options.sizes or () if s in profile.PROFILE_SIZES]
    methods = [m for m in profile.PROFILE_METHODS if m in (options.methods or ())]
    try:
        rows = profile.profile_requests(endpoints, sizes, methods, calls=4 if options.quick else 12)
    except Exception as e:  # the profile is a complement: a failure is reported, not fatal
        logger.error("profiling %s failed: %s", server.name, e)
        return [{"server": server.name, "error": f"{type(e).__name__}: {e}"}]
    for row in rows:
        row["server"] = server.name
    return rows


def _environment() -> dict[str, Any]:
    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "tritonclient": installed("tritonclient"),
        "grpcio": installed("grpcio"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {_memory_gb():.0f} GB RAM",
        "cpu": _cpu_model(),
        "triton_shm_client": core_methods.competitor_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    return env


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 0.0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"
