"""The Ray half of ``make demo``: node actors, the Serve app from deployments/, Ray Data."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import numpy as np
import ray
import tritonclient.http as httpclient
import yaml
from ray import serve

from ray_triton_shm._private.bench import ray_methods
from ray_triton_shm._private.bench.core_methods import OutputMismatch
from ray_triton_shm._private.bench.frontdoor_callers import CallerPool
from ray_triton_shm._private.bench.measure import time_call
from ray_triton_shm._private.cli.demo_log import capture_ray_loggers
from ray_triton_shm._private.triton.repository import examples_serve_config
from ray_triton_shm.node import get_node_actor, shutdown_node_actors
from ray_triton_shm.serve import run_config_file

MB = 1024 * 1024
DATA_BATCH = 64


def run_ray_demo(
    config_file: str | None = None, *, quick: bool = False, hold: bool = False
) -> list[dict[str, object]]:
    """Start local Ray, deploy the Serve app from a config file, call it every way, print a table.

    Args:
        config_file: Serve config file; ``deployments/triton_shm.yaml`` by default.
        quick: Fewer rows and repetitions.
        hold: Afterwards keep everything up until SIGINT/SIGTERM, so that
            ``ray-triton-shm status`` can be run from another shell.

    Returns:
        One row per path with MB/s over shm and over plain gRPC.

    Raises:
        RuntimeError: An output did not match.
    """
    path = config_file or examples_serve_config()
    port = yaml.safe_load(Path(path).read_text()).get("http_options", {}).get("port", 8000)
    rows: list[dict[str, object]] = []
    failures: list[str] = []
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    if logging.getLogger().handlers:  # under quiet_logs: Ray just gave its loggers their own handlers
        capture_ray_loggers()
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        print(f"deploying Serve app from {path} ...", flush=True)
        handle = run_config_file(path)["triton"]
        info = ray.get(get_node_actor().info.remote())
        print(f"node actor: Triton {info.version} pid {info.triton_pid} at {info.grpc_url}", flush=True)

        # Handle: numpy in, numpy out; shm to Triton vs the same replica over gRPC.
        x = np.random.default_rng(0).random((1, 4 * MB), dtype=np.float32)  # 16 MB
        out = handle.infer.remote("identity", {"INPUT0": x}).result()
        if not np.array_equal(out["OUTPUT0"], x):
            failures.append("serve handle")
        shm = time_call(lambda: handle.infer.remote("identity", {"INPUT0": x}).result(), x.nbytes, repeats=5)
        grpc = time_call(
            lambda: handle.infer_grpc.remote("identity", {"INPUT0": x}).result(), x.nbytes, repeats=3
        )
        rows.append(_row("Serve handle, identity 16 MB", shm.mb_per_s, grpc.mb_per_s, "handle"))

        # HTTP: unmodified tritonclient.http against Serve vs directly against Triton's HTTP.
        # Both clients closed here: the garbage collector would close them on any thread, and
        # on one of Ray's, gevent (under tritonclient.http) crashes the process.
        with (
            httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120) as serve_http,
            httpclient.InferenceServerClient(info.http_url, network_timeout=120) as triton_http,
        ):

            def http_call(client: httpclient.InferenceServerClient) -> np.ndarray:
                tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                return client.infer("identity", [tensor]).as_numpy("OUTPUT0")

            if not np.array_equal(http_call(serve_http), x):
                failures.append("serve http")
            via_serve = time_call(lambda: http_call(serve_http), x.nbytes, repeats=3)
            direct = time_call(lambda: http_call(triton_http), x.nbytes, repeats=3)
        rows.append(_row("HTTP (tritonclient.http) 16 MB", via_serve.mb_per_s, direct.mb_per_s, "http"))

        # The front door: tritonclient processes (outside Ray) at 1 MB, ours vs Triton's own endpoints.
        door = _frontdoor(path)
        if door is not None:
            front = _frontdoor_rows(door, info, seconds=1.5 if quick else 3.0)
            failures.extend(f"front door {r['path']}: {r['error']}" for r in front if r.get("error"))
            rows.extend(front)

        # Ray Data: image rows through multi_io, our predictor vs a plain tritonclient.grpc one,
        # in steady state (from the first output batch on), as the benchmark times them.
        count = 256 if quick else 1024
        source = ray_methods.make_source(count, DATA_BATCH)
        speeds = {}
        for method in ("data-ours", "data-grpc"):
            try:
                timing = ray_methods.run_data(method, source, count, DATA_BATCH, 1, None, info.grpc_url)
            except OutputMismatch as e:
                failures.append(f"ray data {method}: {e}")
                speeds[method] = float("nan")
            else:
                speeds[method] = timing.rows_per_s * ray_methods.ROW_BYTES / 1e6
        del source
        rows.append(_row(f"Ray Data multi_io {count} rows", speeds["data-ours"], speeds["data-grpc"], "data"))
        _print([r for r in rows if not str(r["path"]).startswith("frontdoor")])
        _print_frontdoor([r for r in rows if str(r["path"]).startswith("frontdoor")])
        if hold:
            _hold(ray.get_runtime_context().gcs_address)
    finally:
        serve.shutdown()
        shutdown_node_actors()
        ray.shutdown()
    if failures:
        raise RuntimeError(f"outputs did not match for: {failures}")
    return rows


FRONTDOOR_CALLERS = 8


def _frontdoor(path: str) -> dict[str, object] | None:
    """The ``frontdoor`` args of the config's ``triton`` app (``None``: it has none)."""
    for application in yaml.safe_load(Path(path).read_text()).get("applications", []):
        if application.get("name") == "triton":
            return (application.get("args") or {}).get("frontdoor")
    return None


def _frontdoor_rows(door: dict[str, object], info: object, seconds: float) -> list[dict[str, object]]:
    """1 MB identity from caller processes: the front door's HTTP and gRPC vs Triton's own."""
    host = str(door.get("host") or "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    rows = []
    pool = CallerPool(FRONTDOOR_CALLERS)
    try:
        for protocol, port, triton_url in (
            ("http", door.get("http_port"), info.http_url),  # type: ignore[attr-defined]
            ("grpc", door.get("grpc_port"), info.grpc_url),  # type: ignore[attr-defined]
        ):
            if port is None:
                continue
            ours = pool.run(protocol, [f"{host}:{port}"], "identity", MB, FRONTDOOR_CALLERS, seconds)
            theirs = pool.run(protocol, [triton_url], "identity", MB, FRONTDOOR_CALLERS, seconds)
            rows.append(
                {
                    "case": f"{protocol.upper()} front door :{port} vs Triton's own",
                    "path": f"frontdoor-{protocol}",
                    "shm_mb_s": ours.mb_s,
                    "grpc_mb_s": theirs.mb_s,
                    "error": ours.error or theirs.error,
                }
            )
    finally:
        pool.close()
    return rows


def _print_frontdoor(rows: list[dict[str, object]]) -> None:
    if not rows:
        return
    header = f"{'Front door, identity 1 MB':<40} {'ours MB/s':>10} {'Triton MB/s':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ours, theirs = float(r["shm_mb_s"]), float(r["grpc_mb_s"])
        print(f"{r['case']:<40} {ours:>10.1f} {theirs:>12.1f} {ours / theirs:>6.2f}x")
    print(f"({FRONTDOOR_CALLERS} caller processes, unmodified tritonclient, every output checked;")
    print(" the full table: python -m ray_triton_shm bench --frontdoor)")
    print()


def _hold(address: str) -> None:
    """Block until SIGINT or SIGTERM, telling the user how to look at the running cluster."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"holding: Ray at {address}, Serve on the config's HTTP port, Triton under its node actor.")
        print(f"  in another shell: ray-triton-shm status --address {address}")
        print("  (or just `ray-triton-shm status`: address 'auto' finds this cluster)")
        print("Ctrl-C (or SIGTERM) stops everything.", flush=True)
        while not stop.wait(0.5):
            pass
        print("stopping ...", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _row(label: str, shm: float, grpc: float, path: str) -> dict[str, object]:
    return {"case": label, "path": path, "shm_mb_s": shm, "grpc_mb_s": grpc}


def _print(rows: list[dict[str, object]]) -> None:
    header = f"{'Ray path':<34} {'shm MB/s':>10} {'gRPC MB/s':>10} {'speedup':>8}"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        shm, grpc = float(r["shm_mb_s"]), float(r["grpc_mb_s"])
        print(f"{r['case']:<34} {shm:>10.1f} {grpc:>10.1f} {shm / grpc:>7.1f}x")
    print("(HTTP row: Serve with shm behind it vs tritonclient.http straight to Triton's HTTP)")
    print()
