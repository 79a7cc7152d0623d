"""The Ray rows of a benchmark run: Serve handles and ingresses, your own app, Ray Data."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray.data
from ray import serve

from ray_triton_shm._private.bench import app_methods, http_ingress, ray_methods
from ray_triton_shm._private.bench.cells import failed, run_group
from ray_triton_shm._private.bench.core_methods import Endpoints, make_inputs
from ray_triton_shm._private.bench.options import DATA_METHODS, BenchOptions, Record
from ray_triton_shm._private.bench.servers import BenchServer
from ray_triton_shm._private.bench.timing import Progress

if TYPE_CHECKING:
    from ray_triton_shm._private.bench.ray_methods import DataTiming

logger = logging.getLogger(__name__)


def quiet_ray() -> None:
    """Keep Serve's and Data's INFO lines and progress bars out of the report."""
    for name in ("ray", "ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    if hasattr(context, "enable_operator_progress_bars"):
        context.enable_operator_progress_bars = False


def run_ray(
    options: BenchOptions, endpoints: Endpoints, node_config: Any, progress: Progress, server: BenchServer
) -> list[Record]:
    """The Serve rows on ``server``, then (unless only Serve rows were asked for) the app and Data rows."""
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
            records.extend(run_group(openers, size, concurrency, options, "serve", progress))

    serve.shutdown()
    if options.serve_methods:  # only the Serve rows asked for
        return records
    records.extend(run_apps(options, node_config, progress, server))
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
            records.append(failed(method, ray_methods.ROW_BYTES, options.data_actors, errors[method], "data"))
        else:
            records.append(data_record(method, options, timings))
    return records


def run_apps(
    options: BenchOptions, node_config: Any, progress: Progress, server: BenchServer
) -> list[Record]:
    """Your own deployment's rows (deployments/image_app.py over HTTP); none outside a source checkout."""
    try:
        app_methods.image_module()
        import PIL  # noqa: F401  # lazy: probes for the optional Pillow
    except ImportError as e:
        logger.warning("skipping the image app rows: %s", e)
        return []
    return app_methods.run_app_rows(options, node_config, server.multi_io, progress)


def data_record(method: str, options: BenchOptions, runs: Sequence[DataTiming]) -> Record:
    """Rows per second over every round's steady state; percentiles of the gaps between batches."""
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
