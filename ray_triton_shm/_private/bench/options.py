"""What a benchmark run measures (:class:`BenchOptions`) and records (:class:`Record`); the CLI's lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.bench.core_methods import CORE_METHODS
from ray_triton_shm._private.bench.servers import SERVERS

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
        settle_s: Before its timed calls, a cell waits (this long at most) for the
            machine's CPUs to go idle, so what the cell before left running is
            not timed with it (quick 0.25, full 1.0; 0: no wait).
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
    settle_s: float | None = None

    def __post_init__(self) -> None:
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.settle_s is not None and not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")

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
            settle_s=self.settle_s if self.settle_s is not None else (0.25 if quick else 1.0),
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
