"""The ``ray-triton-shm`` command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.triton import server_env
from ray_triton_shm.config import ServerConfig


def _setup(args: argparse.Namespace) -> int:
    plan = server_env.find_tritonserver(ServerConfig(model_repository="-"))
    print(f"tritonserver: {plan.binary} ({plan.source})")
    warning = server_env.cpu_fallback_warning(plan)
    if warning:
        print(f"\n{'!' * 78}\n{warning}\n{'!' * 78}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    # Each command loads its own modules: one that needs neither Ray nor a protocol's client
    # (``bench-cuda`` on a machine with only tritonclient's gRPC half) never imports them.
    from ray_triton_shm._private.cli.demo import run_demo  # lazy: each command loads its own
    from ray_triton_shm._private.cli.demo_log import quiet_logs  # lazy: with the demo

    if args.verbose:
        log = None
    else:
        log = quiet_logs()
    with log if log is not None else _no_log() as path:
        try:
            if not args.hold:
                run_demo(args.model_repository, quick=args.quick)
            if not args.core_only:
                from ray_triton_shm._private.cli.demo_ray import run_ray_demo  # lazy: loads Ray

                run_ray_demo(args.config, quick=args.quick, hold=args.hold)
        finally:
            if path is not None:
                print(f"logs of Ray, Ray Data, Triton and warnings: {path}", flush=True)
    return 0


@contextlib.contextmanager
def _no_log() -> Iterator[None]:
    yield None


def _status(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.cli.status import run as run_status  # lazy: each command loads its own

    try:
        return run_status(args.address, as_json=args.json, write=print, timeout_s=args.timeout)
    except ConnectionError as e:
        print(f"no Ray cluster at {args.address!r}: {e}", file=sys.stderr)
        return 2


def _shutdown(args: argparse.Namespace) -> int:
    import ray  # lazy: only the commands that need Ray load it

    from ray_triton_shm.node import shutdown_node_actors  # lazy: loads Ray

    try:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        print(f"no Ray cluster at {args.address!r}: {e}", file=sys.stderr)
        return 2
    try:
        count = shutdown_node_actors(timeout_s=args.timeout)
    finally:
        ray.shutdown()
    print(f"stopped {count} node actor(s) (their Tritons and segments are gone)")
    return 0


def _models(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.node import model_control  # lazy: loads Ray

    try:
        return model_control.run(args.address, args.action, args.models, args.config_file, print)
    except ConnectionError as e:
        print(f"no Ray cluster at {args.address!r}: {e}", file=sys.stderr)
        return 2


def _cleanup(args: argparse.Namespace) -> int:
    # Segments whose owner holds its lock are live, even when the owner runs in another
    # pid namespace (a container sharing /dev/shm) and its pid means nothing here.
    stale = sweep.stale_segments()
    if not stale:
        print("no stale segments under /dev/shm/" + segment.SEGMENT_PREFIX + "*")
        return 0
    if not args.yes:
        for name in stale:
            print("would remove " + name)
        print("dry run: pass --yes to remove them")
        return 0
    removed = sweep.sweep_stale_segments()
    for name in removed:
        print("removing " + name)
    kept = sorted(set(stale) - set(removed))
    if kept:
        print(f"{len(kept)} segment(s) were no longer stale or already gone when removing: left alone")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.attacks:  # the attack table only (its own Ray, the shipped Serve config, caller processes)
        from ray_triton_shm._private.bench.attacks import table  # lazy: the benchmark loads only for bench

        return table.main(["--out", args.out])
    if args.frontdoor:  # the front-door table only (its own Ray, Serve app and caller processes)
        from ray_triton_shm._private.bench import frontdoor  # lazy: the benchmark loads only for bench

        argv = ["--quick"] if args.quick else []
        if args.sizes:
            argv += ["--sizes", args.sizes]
        if args.servers:
            argv += ["--servers", args.servers]
        if args.rounds:
            argv += ["--rounds", str(args.rounds)]
        return frontdoor.main([*argv, "--out", args.out])
    # lazy: the benchmark loads only for the bench commands
    from ray_triton_shm._private.bench import runner
    from ray_triton_shm._private.bench.core_methods import CORE_METHODS
    from ray_triton_shm._private.bench.options import SERVE_METHODS, BenchOptions, methods_arg, parse_sizes
    from ray_triton_shm._private.bench.servers import parse_servers

    options = BenchOptions(
        quick=args.quick,
        sizes=parse_sizes(args.sizes) if args.sizes else None,
        concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None,
        methods=methods_arg(args.methods, list(CORE_METHODS)),
        ray=not args.no_ray,
        serve_sizes=parse_sizes(args.serve_sizes) if args.serve_sizes else None,
        serve_concurrency=tuple(int(c) for c in args.serve_concurrency.split(","))
        if args.serve_concurrency
        else None,
        serve_methods=methods_arg(args.serve_methods, list(SERVE_METHODS)),
        data_rows=args.data_rows,
        data_batch=args.data_batch,
        rounds=args.rounds,
        out_dir=args.out,
        model_repository=args.model_repository,
        native_repository=args.native_repository,
        servers=parse_servers(args.servers),
        profile=not args.no_profile,
        progress=not args.no_progress,
    )
    records = runner.run_bench(options, write=print)
    return 0 if records and all(r.ok for r in records) else 1


def _bench_sharing(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.bench import sharing  # lazy: the benchmark loads only for its commands

    return sharing.command(args.model_repository, args.size, args.rounds, args.calls, write=print)


def _sizes_mb(text: str) -> tuple[int, ...]:
    """``64`` or ``64,256``: positive sizes in MB (argparse type)."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are whole MB separated by commas, got {text!r}") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive MB, got {text!r}")
    return sizes


def _bench_cuda(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.bench import cuda_paths  # lazy: the benchmark loads only for its commands

    return cuda_paths.command(
        args.mb, args.repeats, args.url, args.model_repository, args.json, gpu_model=args.gpu_model
    )


def _bench_docs(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.bench import docs  # lazy: the benchmark loads only for its commands

    docs.update_docs(args.results_dir, args.docs_file)
    return 0


def _soak(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.cli import soak  # lazy: tritonclient.http

    return soak.command(args.duration, args.callers, args.slots, args.target)


def _soak_faults(args: argparse.Namespace) -> int:
    from ray_triton_shm._private.cli.soak_faults import run_fault_soak  # lazy: tritonclient.http

    report = run_fault_soak(
        args.config,
        duration_s=args.duration,
        callers=args.callers,
        faults=[f for f in args.faults.split(",") if f],
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        app=args.app,
        write=lambda line: print(line, flush=True),
    )
    print(report.summary(), flush=True)
    return 0 if not report.problems else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-triton-shm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="find or provision the Triton server").set_defaults(func=_setup)
    demo = sub.add_parser("demo", help="run the example models through shm and gRPC")
    demo.add_argument("--model-repository", default=None)
    demo.add_argument("--quick", action="store_true")
    demo.add_argument("--core-only", action="store_true", help="skip the Ray part")
    demo.add_argument("--config", default=None, help="Serve config file for the Ray part")
    demo.add_argument(
        "--hold",
        action="store_true",
        help="Ray part only, then keep Ray, Serve and Triton up (for `status`) until Ctrl-C",
    )
    demo.set_defaults(func=_demo)
    status = sub.add_parser("status", help="per node: Triton, models, slot pools, bytes moved")
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each node")
    status.set_defaults(func=_status)
    bench = sub.add_parser("bench", help="benchmark every path against gRPC, HTTP and triton-shm-client")
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (< 3 min)")
    bench.add_argument("--sizes", help="payload sizes, e.g. 4K,64K,1M,16M,128M")
    bench.add_argument("--concurrency", help="caller counts, e.g. 1,4,16")
    bench.add_argument("--methods", help="core methods to run (default: all)")
    bench.add_argument("--serve-sizes", help="payload sizes of the Serve cells")
    bench.add_argument("--serve-concurrency", help="caller counts of the Serve cells, e.g. 1,4")
    bench.add_argument(
        "--serve-methods",
        help="only these Serve rows, e.g. serve-grpc,serve-slotref (then no image-app or Ray Data rows)",
    )
    bench.add_argument("--data-rows", type=int, default=None, help="rows of the Ray Data run")
    bench.add_argument("--data-batch", type=int, default=64, help="rows per map_batches batch")
    bench.add_argument(
        "--rounds", type=int, default=None, help="rounds per cell, methods taking turns (quick 1, full 3)"
    )
    bench.add_argument("--no-ray", action="store_true", help="core methods only, plain Triton server")
    bench.add_argument("--out", default="bench-results", help="output directory")
    bench.add_argument("--model-repository", default=None, help="the Python backend's models")
    bench.add_argument("--native-repository", default=None, help="the native backend's models (built)")
    bench.add_argument(
        "--servers", default=None, help="servers to measure, main first (default: native,python)"
    )
    bench.add_argument(
        "--frontdoor",
        action="store_true",
        help="only the front-door table (perf_analyzer vs Triton's own endpoints), in OUT/frontdoor.md",
    )
    bench.add_argument(
        "--attacks",
        action="store_true",
        help="only the attack table: every attack on the front door and on Triton's own ports, side by side",
    )
    bench.add_argument("--no-profile", action="store_true", help="skip the per-request profile")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=_bench)
    text = "what sharing slots between processes costs per request (private vs shared pool, one run)"
    sharing = sub.add_parser("bench-sharing", help=text, description=text)
    sharing.add_argument("--size", type=int, default=4096, help="payload bytes")
    sharing.add_argument("--rounds", type=int, default=6)
    sharing.add_argument("--calls", type=int, default=400, help="timed calls per round")
    sharing.add_argument("--model-repository", default=None)
    sharing.set_defaults(func=_bench_sharing)
    text = "CUDA shm vs system shm vs plain gRPC for one large tensor through identity (needs a GPU)"
    cuda = sub.add_parser("bench-cuda", help=text, description=text)
    cuda.add_argument(
        "--mb", type=_sizes_mb, default=(64,), help="tensor sizes in MB, e.g. 64 or 64,256 (default 64)"
    )
    cuda.add_argument("--repeats", type=int, default=10)
    cuda.add_argument("--url", help="use a running Triton (gRPC host:port) instead of starting one")
    cuda.add_argument(
        "--model-repository",
        default=None,
        help="models of the started server (default deployments/models, or deployments/native_models_gpu)",
    )
    cuda.add_argument(
        "--gpu-model",
        action="store_true",
        help="the native backend's GPU model (identity_gpu, KIND_GPU) and the device's own copy rate",
    )
    cuda.add_argument("--json", help="also write the rows to this file")
    cuda.set_defaults(func=_bench_cuda)
    text = "copy the latest benchmark run (report and plots) into docs/benchmarks.md"
    bench_docs = sub.add_parser("bench-docs", help=text, description=text)
    bench_docs.add_argument("results_dir", nargs="?", default="bench-results", help="a bench run's output")
    bench_docs.add_argument("docs_file", nargs="?", default="docs/benchmarks.md", help="the page to update")
    bench_docs.set_defaults(func=_bench_docs)
    text = "a bounded soak: many callers on fewer slots, through the client and Serve, every answer checked"
    soak_cmd = sub.add_parser("soak", help=text, description=text)
    soak_cmd.add_argument("--duration", type=float, default=120.0, help="seconds per target")
    soak_cmd.add_argument("--callers", type=int, default=16)
    soak_cmd.add_argument("--slots", type=int, default=4, help="slots shared by the callers")
    soak_cmd.add_argument("--target", choices=("client", "serve", "all"), default="all")
    soak_cmd.set_defaults(func=_soak)
    faults = sub.add_parser(
        "soak-faults",
        help="external tritonclient callers through the front door while a replica, "
        "the node actor and Triton are killed; every answer checked, leftovers looked for",
    )
    faults.add_argument("--config", default=None, help="Serve config file (default: the example config)")
    faults.add_argument("--duration", type=float, default=600.0, help="least seconds to run")
    faults.add_argument("--callers", type=int, default=8, help="caller processes, half HTTP, half gRPC")
    faults.add_argument(
        "--faults", default="replica,node-actor,triton", help="what to SIGKILL, in order (comma-separated)"
    )
    faults.add_argument("--host", default=None, help="address callers connect to (default: the config's)")
    faults.add_argument("--http-port", type=int, default=None, help="default: http_options.port")
    faults.add_argument("--grpc-port", type=int, default=None, help="default: grpc_options.port")
    faults.add_argument("--app", default=None, help="application called (default: the config's first)")
    faults.set_defaults(func=_soak_faults)
    shutdown = sub.add_parser("shutdown", help="stop every node actor now: Tritons, pools, segments")
    shutdown.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    shutdown.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each actor")
    shutdown.set_defaults(func=_shutdown)
    models = sub.add_parser(
        "models", help="load, unload or reload models on every node's Triton (explicit model control)"
    )
    models.add_argument("action", choices=["load", "unload", "reload"])
    models.add_argument("models", nargs="+", help="model names")
    models.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    models.add_argument("--config-file", default=None, help="JSON model config to load instead")
    models.set_defaults(func=_models)
    cleanup = sub.add_parser("cleanup", help="remove segments whose owner is gone, in any container")
    cleanup.add_argument("--yes", action="store_true", help="remove, not just list")
    cleanup.set_defaults(func=_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)
