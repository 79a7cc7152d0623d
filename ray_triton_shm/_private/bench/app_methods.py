"""Your own deployment in the benchmark: deployments/image_app.py over HTTP, shm vs gRPC.

The same application (decode a PNG, normalise it, run ``multi_io``, answer
JSON) deployed twice behind Serve's HTTP proxy: ``app-image-shm`` writes the
tensor into a leased slot of the node's pools, ``app-image-grpc`` sends it to
the same Triton with ``tritonclient.grpc``. Callers POST the same image and
check the answer against numpy's.

Run just this part::

    python -m ray_triton_shm._private.bench.app_methods --callers 1,4 --rounds 3

(``make bench`` runs them too, after the Serve handle rows, on each server's ``multi_io``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray
import requests
from ray import cloudpickle, serve

from ray_triton_shm._private.bench import report
from ray_triton_shm._private.bench.cells import run_group
from ray_triton_shm._private.bench.core_methods import Caller, Cell, OutputMismatch
from ray_triton_shm._private.bench.options import BenchOptions
from ray_triton_shm._private.bench.timing import Progress
from ray_triton_shm._private.triton.server_launch import free_ports
from ray_triton_shm.node import NodeConfig, shutdown_node_actors

APP_METHODS = ("app-image-shm", "app-image-grpc")
BASE = "app-image-grpc"
ROUTES = {"app-image-shm": "/image-shm", "app-image-grpc": "/image-grpc"}
_REPO = Path(__file__).resolve().parents[3]
_MEAN = np.array([0.485, 0.456, 0.406])
_STD = np.array([0.229, 0.224, 0.225])


def image_module() -> Any:
    """``deployments.image_app`` of this checkout.

    Raises:
        ImportError: Not a source checkout (the example app is not in the wheel).
    """
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    module = importlib.import_module("deployments.image_app")
    # Replicas get the module's code from here: they need not run from the repository root.

    cloudpickle.register_pickle_by_value(module)
    return module


def make_image(seed: int = 18) -> tuple[bytes, list[int]]:
    """A 224x224 PNG of random pixels, and the top-5 indices ``multi_io`` gives for it (numpy's)."""
    from PIL import Image  # lazy: Pillow is optional (the examples extra)

    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    image = ((pixels / 255.0 - _MEAN) / _STD).transpose(2, 0, 1)
    top5 = list(np.argsort(-image.reshape(512, 294).sum(axis=-1))[:5])
    return buffer.getvalue(), [int(i) for i in top5]


def start_apps(node_args: Mapping[str, Any], model: str, port: int) -> str:
    """Serve with its HTTP proxy on ``port`` and both variants of the app; their base URL."""
    module = image_module()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for method, route in ROUTES.items():
        transport = method.rsplit("-", 1)[1]
        args = {**node_args, "model": model, "transport": transport}
        serve.run(module.app(args), name=method, route_prefix=route)
    return f"http://127.0.0.1:{port}"


def app_cell(method: str, base_url: str, body: bytes, top5: list[int], callers: int) -> Cell:
    """``callers`` HTTP clients (a session each) posting ``body`` to one variant of the app."""
    sessions = [requests.Session() for _ in range(callers)]
    url = base_url + ROUTES[method]

    def caller(session: Any) -> Caller:
        def call(check: bool) -> object:
            response = session.post(url, data=body, headers={"content-type": "image/png"}, timeout=120)
            if response.status_code != 200:
                raise OutputMismatch(f"{method}: HTTP {response.status_code}: {response.text[:200]}")
            if check:
                got = [entry["index"] for entry in response.json()["top5"]]
                if got != top5:
                    raise OutputMismatch(f"{method}: top-5 {got}, numpy's {top5}")
            return response

        return call

    return Cell([caller(s) for s in sessions], closers=[s.close for s in sessions], paths={"http"})


def node_args_of(config: Any) -> dict[str, Any]:
    """The Serve app's ``args`` that build ``config`` again (so the app uses the same node Triton)."""
    fields = dataclasses.asdict(config)
    server = fields.pop("server")
    return {"model_repository": server.pop("model_repository"), "server": server, **fields}


def run_app_rows(options: Any, node_config: Any, model: str, progress: Any) -> list[Any]:
    """Both variants of the app on ``node_config``'s Triton, one cell per caller count; records.

    Starts Serve with an HTTP proxy on a free port and shuts it down after.
    """
    args = node_args_of(node_config)
    if NodeConfig.from_args(**args).fingerprint() != node_config.fingerprint():
        logging.getLogger(__name__).warning("the image app gets a Triton of its own (config differs)")
    body, top5 = make_image()
    records = []
    try:
        base = start_apps(args, model, free_ports("127.0.0.1", 1)[0])
        for count in options.serve_concurrency or (1,):
            openers = [(m, lambda m=m, c=count: app_cell(m, base, body, top5, c)) for m in APP_METHODS]
            records.extend(app_records(run_group(openers, len(body), count, options, "app", progress)))
    finally:
        serve.shutdown()
    return records


def main(argv: list[str] | None = None) -> int:
    """Run only the app rows: a local Ray, the node's Triton, both variants, a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", default="1,4", help="comma list of concurrent HTTP callers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=6.0, help="time per cell, all rounds")
    parsed = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    callers = tuple(int(c) for c in parsed.callers.split(","))
    config = NodeConfig.from_args(model_repository="examples", pools={"multi_io": {"slots": 8}})
    options = BenchOptions(
        rounds=parsed.rounds, budget_s=parsed.budget_s, min_calls=8, warmup=2, serve_concurrency=callers
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        progress = Progress(len(callers) * len(APP_METHODS) * parsed.rounds)
        records = run_app_rows(options, config, "multi_io", progress)
        progress.close()
    finally:
        shutdown_node_actors()
        ray.shutdown()
    print(report.app_table(records))
    return 0 if all(r.ok for r in records) else 1


def app_records(records: list[Any]) -> list[Any]:
    """``records`` with requests/s filled in (``throughput_mb_s`` is of the encoded image)."""
    for record in records:
        if record.ok:
            record.rows_per_s = record.throughput_mb_s * 1e6 / record.payload_bytes
            record.path = f"http {record.rows_per_s:,.1f} req/s"
    return records


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)")
    sys.exit(code)
