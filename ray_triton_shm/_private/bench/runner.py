"""The benchmark run: one Triton, two servers' models, every method, every size and caller count.

Flow: build the run's model repository (the native C backend's identity and
multi_io, and the Python backend's, see :mod:`.servers`), start Ray and the node
actor on it (or, with ``ray=False``, a plain
:class:`~ray_triton_shm.server.TritonServer`), then per server: every core
method on its identity, the per-request profile, the Serve and Data methods;
and write ``results.json``, the plots and ``report.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_triton_shm._private.bench import core_methods, profile, report
from ray_triton_shm._private.bench.core_methods import CORE_METHODS, Endpoints, make_inputs
from ray_triton_shm._private.bench.servers import SERVERS, BenchServer, build_repository
from ray_triton_shm._private.bench.timing import CellTiming, Progress, run_callers

if TYPE_CHECKING:
    from ray_triton_shm._private.bench.ray_methods import DataTiming

logger = logging.getLogger(__name__)

KB = 1024
MB = 1024 * KB
FULL_SIZES = (4 * KB, 64 * KB, MB, 16 * MB, 128 * MB)
QUICK_SIZES = (4 * KB, MB, 16 * MB)
# Skipped: 16 callers x 128 MB. Each caller holds its input and a copied output
# (256 MB), the shm methods add a 256 MB slot per caller and the server's Python
# backend two 128 MB tensors per request in flight; the gRPC/HTTP methods add
# several serialised copies per request. That is 8-20 GB per method on a 24 GB
# machine shared with the Ray object store, and minutes of gRPC time.
MAX_BYTES_IN_FLIGHT = 16 * 128 * MB - 1
# data-local (no Triton) is the reference: Ray Data's own cost per batch.
DATA_METHODS = ("data-ours", "data-grpc", "data-local")
SERVE_METHODS = (
    "serve-ours",
    "serve-slotref",
    "serve-grpc",
    "serve-echo",
    "ingress-grpc",
    "triton-grpc",
    "ingress-http",
    "ingress-http-grpc",
    "triton-http",
)
"""The Serve rows (see ``ray_methods.start_serve_apps``)."""


@dataclass(frozen=True)
class BenchOptions:
    """What to run.

    Attributes:
        quick: Fewer sizes, callers and repetitions (< 3 minutes on 2 cores).
        sizes: Payload bytes per request; None picks by ``quick``.
        concurrency: Caller counts; None picks by ``quick``.
        methods: Core method names to run; None runs all.
        ray: Also run the Serve and Data methods (and use the node actor's Triton).
        serve_sizes / serve_concurrency: Serve cells.
        serve_methods: Only these Serve handle rows (and then no image-app or
            Ray Data rows); None runs every Serve, app and Data row.
        data_rows / data_batch / data_actors: Ray Data run (per round).
        rounds: Each cell runs in this many rounds, the methods of one payload
            size and caller count taking turns (in a rotating order), so a
            slow spell of a shared machine falls on every method alike rather
            than on whichever ran then. Ray Data alternates its two methods
            the same way. Ratios between methods are what the run is for.
        budget_s: Per cell (all rounds): callers stop after this long once they have ``min_calls``.
        min_calls: Timed calls per cell at least (spread over the callers and rounds).
        warmup: Checked warm-up calls per caller.
        out_dir: Where results.json, plots and report.md go.
        model_repository: The Python backend's models (``deployments/models`` by default).
        native_repository: The native backend's models (``deployments/native_models``, built).
        servers: Which servers' models to measure, main table first (``native``, ``python``).
        profile: Also time where a request's time goes on each server (Triton's own statistics).
        progress: Show the progress bar on stderr.
    """

    quick: bool = False
    sizes: tuple[int, ...] | None = None
    concurrency: tuple[int, ...] | None = None
    methods: tuple[str, ...] | None = None
    ray: bool = True
    serve_sizes: tuple[int, ...] | None = None
    serve_concurrency: tuple[int, ...] | None = None
    serve_methods: tuple[str, ...] | None = None
    data_rows: int | None = None
    data_batch: int = 64
    data_actors: int = 1
    rounds: int | None = None
    budget_s: float | None = None
    min_calls: int | None = None
    warmup: int = 1
    out_dir: str = "bench-results"
    model_repository: str | None = None
    native_repository: str | None = None
    servers: tuple[str, ...] | None = None
    profile: bool = True
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    def resolved(self) -> BenchOptions:
        """A copy with every None replaced by the default of the chosen mode."""
        quick = self.quick
        return BenchOptions(
            quick=quick,
            sizes=self.sizes or (QUICK_SIZES if quick else FULL_SIZES),
            concurrency=self.concurrency or ((1, 4) if quick else (1, 4, 16)),
            methods=self.methods or tuple(CORE_METHODS),
            ray=self.ray,
            serve_sizes=self.serve_sizes or ((16 * MB,) if quick else (MB, 16 * MB)),
            serve_concurrency=self.serve_concurrency or ((1,) if quick else (1, 4)),
            serve_methods=self.serve_methods,
            data_rows=self.data_rows or (256 if quick else 1024),
            data_batch=self.data_batch,
            data_actors=self.data_actors,
            rounds=self.rounds or (1 if quick else 3),
            budget_s=self.budget_s if self.budget_s is not None else (0.4 if quick else 1.5),
            min_calls=self.min_calls or (3 if quick else 6),
            warmup=self.warmup,
            out_dir=self.out_dir,
            model_repository=self.model_repository,
            native_repository=self.native_repository,
            servers=self.servers or tuple(SERVERS),
            profile=self.profile,
            progress=self.progress,
            plots=self.plots,
        )


@dataclass
class Record:
    """One measured cell (a row of results.json)."""

    method: str
    payload_bytes: int
    concurrency: int
    throughput_mb_s: float
    p50_ms: float
    p99_ms: float
    calls: int
    ok: bool
    group: str = "core"
    path: str = ""
    server: str = "python"
    rows_per_s: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _model_repository(options: BenchOptions) -> str:
    from ray_triton_shm._private.demo import default_model_repository

    return os.path.abspath(options.model_repository or default_model_repository())


def _identity_pool(max_bytes: int, slots: int) -> Any:
    from ray_triton_shm.config import PoolConfig

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
    from ray_triton_shm.config import ServerConfig

    if not options.ray:
        from ray_triton_shm.server import TritonServer

        with TritonServer(ServerConfig(model_repository=repository)) as server:
            info = {"triton": server.version, "triton_source": server.binary_source}
            yield Endpoints(server.grpc_url, server.http_url), info, None
        return
    import ray

    from ray_triton_shm._private.node_lifecycle import attach
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
    _quiet_ray()
    try:
        # The run is a user of the node's Triton for its whole length: the core cells talk to
        # Triton straight, and an actor nobody attached to goes away after idle_shutdown_s.
        _, node = attach(node_config, f"bench-{os.getpid()}", os.getpid(), "client")
        info = {"triton": node.version, "ray": ray.__version__}
        yield Endpoints(node.grpc_url, node.http_url), info, node_config
    finally:
        try:
            from ray import serve

            serve.shutdown()
        finally:
            shutdown_node_actors()
            ray.shutdown()


def _quiet_ray() -> None:
    """Keep Serve's and Data's INFO lines and progress bars out of the report."""
    import ray.data

    for name in ("ray", "ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    if hasattr(context, "enable_operator_progress_bars"):
        context.enable_operator_progress_bars = False


def _label(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def _record_from(
    method: str, size: int, concurrency: int, timing: Any, paths: set[str], group: str
) -> Record:
    wall_mb_s = timing.calls * size / timing.elapsed_s / 1e6
    return Record(
        method=method,
        payload_bytes=size,
        concurrency=concurrency,
        # One caller: payload / median latency, which shrugs off stalls caused by
        # other load on the machine. Several: total bytes / wall time, since a
        # per-call median would hide the time callers wait for each other
        # (the GIL, the server's queue) between their timed calls.
        throughput_mb_s=(size / (timing.percentile_ms(50) / 1e3) / 1e6 if concurrency == 1 else wall_mb_s),
        p50_ms=timing.percentile_ms(50),
        p99_ms=timing.percentile_ms(99),
        calls=timing.calls,
        ok=True,
        group=group,
        path="/".join(sorted(paths)),
        extra={"wall_mb_s": round(wall_mb_s, 2)},
    )


def _failed(method: str, size: int, concurrency: int, error: BaseException, group: str) -> Record:
    logger.error("%s %s x%d failed: %s", method, _label(size), concurrency, error)
    nan = float("nan")
    return Record(
        method, size, concurrency, nan, nan, nan, 0, False, group, error=f"{type(error).__name__}: {error}"
    )


def _time_cell(
    open_cell: Callable[[], Any], calls: int, budget_s: float, warmup: int
) -> tuple[CellTiming, set[str]]:
    cell = None
    try:
        cell = open_cell()
        timing = run_callers(cell.callers, warmup=warmup, min_calls=calls, budget_s=budget_s)
        return timing, cell.paths
    finally:
        if cell is not None:
            cell.close()
        gc.collect()


def _run_group(
    openers: Sequence[tuple[str, Callable[[], Any]]],
    size: int,
    concurrency: int,
    options: BenchOptions,
    group: str,
    progress: Progress,
) -> list[Record]:
    """The cells of one payload size and caller count, every method, in ``options.rounds`` rounds.

    Returns:
        One record per method, in the order of ``openers``; a method that failed
        in any round gets a failed record.
    """
    rounds = options.rounds or 1
    per_caller = max(2, -(-(options.min_calls or 1) // concurrency))
    calls = max(1, -(-per_caller // rounds))
    budget_s = (options.budget_s or 1.0) / rounds
    # A lone caller gets one more warm-up call: the first large request grows
    # the server's Python-backend arena, which is not what we want to time.
    warmup = options.warmup + (1 if concurrency == 1 else 0)
    timings: dict[str, list[CellTiming]] = {method: [] for method, _ in openers}
    paths: dict[str, set[str]] = {method: set() for method, _ in openers}
    errors: dict[str, BaseException] = {}
    for index in range(rounds):
        shift = index % len(openers)
        for method, open_cell in [*openers[shift:], *openers[:shift]]:
            progress.step(
                f"{method} {_label(size)} x{concurrency}" + (f" ({index + 1}/{rounds})" if rounds > 1 else "")
            )
            if method not in errors:
                try:
                    timing, cell_paths = _time_cell(open_cell, calls, budget_s, warmup)
                    timings[method].append(timing)
                    paths[method] |= cell_paths
                except Exception as e:
                    errors[method] = e
            progress.advance()
    records = []
    for method, _ in openers:
        if method in errors:
            records.append(_failed(method, size, concurrency, errors[method], group))
        else:
            merged = CellTiming.merged(timings[method])
            record = _record_from(method, size, concurrency, merged, paths[method], group)
            if rounds > 1:  # the spread between rounds says how far one cell can be trusted
                record.extra["mb_s_by_round"] = [
                    round(_record_from(method, size, concurrency, t, set(), group).throughput_mb_s, 2)
                    for t in timings[method]
                ]
            records.append(record)
    return records


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
                group = _run_group(openers, size, concurrency, options, "core", progress)
                records.extend(_tagged(group, server))
                del inputs, openers
            if options.profile:
                progress.step(f"profiling requests on the {server.name} server")
                profiles.extend(_profile(options, endpoints, server))
            if options.ray:
                records.extend(_tagged(_run_ray(options, endpoints, node_config, progress, server), server))
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


def _tagged(records: list[Record], server: BenchServer) -> list[Record]:
    for record in records:
        record.server = server.name
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


def _run_ray(
    options: BenchOptions, endpoints: Endpoints, node_config: Any, progress: Progress, server: BenchServer
) -> list[Record]:
    from ray_triton_shm._private.bench import http_ingress, ray_methods

    records: list[Record] = []
    progress.step("starting Serve")
    handles = ray_methods.start_serve_apps(node_config, endpoints.grpc_url, endpoints.http_url)
    if options.serve_methods:
        handles = {m: h for m, h in handles.items() if m in options.serve_methods}
    for size in options.serve_sizes or ():
        for concurrency in options.serve_concurrency or ():
            inputs = make_inputs(size, concurrency, seed=1)
            openers = [
                (
                    method,
                    lambda m=method, h=handle, i=inputs: (
                        ray_methods.serve_cell(m, h, i, server.identity)
                        if not isinstance(h, str)
                        else http_ingress.http_cell(m, h, i, server.identity)
                        if m in http_ingress.HTTP_METHODS
                        else ray_methods.grpc_ingress_cell(
                            m, h, i, server.identity, "bench-ours" if m == "ingress-grpc" else None
                        )
                    ),
                )
                for method, handle in handles.items()
            ]
            records.extend(_run_group(openers, size, concurrency, options, "serve", progress))
    from ray import serve

    serve.shutdown()
    if options.serve_methods:  # only the Serve rows asked for
        return records
    records.extend(_run_apps(options, node_config, progress, server))
    progress.step(f"making {options.data_rows} image rows")
    source = ray_methods.make_source(options.data_rows or 256, options.data_batch)
    runs: dict[str, list[DataTiming]] = {method: [] for method in DATA_METHODS}
    errors: dict[str, BaseException] = {}
    for index in range(options.rounds or 1):
        # ours, gRPC, local, then local, gRPC, ours, ...: a drift in the machine's
        # speed weighs on ours and gRPC alike.
        order = list(runs) if index % 2 == 0 else list(reversed(runs))
        for method in order:
            progress.step(f"{method} {options.data_rows} rows ({index + 1}/{options.rounds or 1})")
            if method not in errors:
                try:
                    runs[method].append(
                        ray_methods.run_data(
                            method,
                            source,
                            options.data_rows or 256,
                            options.data_batch,
                            options.data_actors,
                            node_config,
                            endpoints.grpc_url,
                            server.multi_io,
                        )
                    )
                except Exception as e:
                    errors[method] = e
            progress.advance()
    for method, timings in runs.items():
        if method in errors:
            records.append(
                _failed(method, ray_methods.ROW_BYTES, options.data_actors, errors[method], "data")
            )
        else:
            records.append(_data_record(method, options, timings))
    return records


def _run_apps(
    options: BenchOptions, node_config: Any, progress: Progress, server: BenchServer
) -> list[Record]:
    """Your own deployment's rows (deployments/image_app.py over HTTP); none outside a source checkout."""
    from ray_triton_shm._private.bench import app_methods

    try:
        app_methods.image_module()
        import PIL  # noqa: F401
    except ImportError as e:
        logger.warning("skipping the image app rows: %s", e)
        return []
    return app_methods.run_app_rows(options, node_config, server.multi_io, progress)


def _data_record(method: str, options: BenchOptions, runs: Sequence[DataTiming]) -> Record:
    """Rows per second over every round's steady state; percentiles of the gaps between batches."""
    from ray_triton_shm._private.bench import ray_methods

    rows_per_s = sum(r.rows_timed for r in runs) / sum(r.span_s for r in runs)
    ordered = sorted(gap for r in runs for gap in r.gaps_s)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, -(-int(q * len(ordered)) // 100) - 1))] * 1e3

    return Record(
        method=method,
        payload_bytes=ray_methods.ROW_BYTES,
        concurrency=options.data_actors,
        throughput_mb_s=rows_per_s * ray_methods.ROW_BYTES / 1e6,
        p50_ms=pct(50),
        p99_ms=pct(99),
        calls=sum(r.rows_seen for r in runs),
        ok=True,
        group="data",
        path="batch gaps",
        rows_per_s=rows_per_s,
        extra={
            "rows": options.data_rows,
            "batch_size": options.data_batch,
            "rounds": len(runs),
            "rows_per_s_by_round": [round(r.rows_per_s, 1) for r in runs],
        },
    )


def _environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

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


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,1M,16M`` -> bytes."""
    units = {"K": KB, "M": MB, "G": 1024 * MB}
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        if not part:
            continue
        factor = units.get(part[-1], 1)
        sizes.append(int(float(part[:-1] if part[-1] in units else part) * factor))
    return tuple(sizes)


def methods_arg(text: str | None, known: Sequence[str]) -> tuple[str, ...] | None:
    """Validate a comma list of method names."""
    if not text:
        return None
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {list(known)}")
    return names
