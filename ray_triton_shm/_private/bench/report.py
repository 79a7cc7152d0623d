"""Tables, target checks, markdown and plots from benchmark records."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KB = 1024
MB = 1024 * KB
BASE = "grpc"
COMPETITOR = "triton-shm-client"


def size_label(size: int) -> str:
    if size >= MB:
        return f"{size / MB:g} MB"
    return f"{size / KB:g} KB" if size >= KB else f"{size} B"


def _index(records: Iterable[Any]) -> dict[tuple[str, int, int], Any]:
    return {(r.method, r.payload_bytes, r.concurrency): r for r in records if r.ok}


def _ratio(a: Any, b: Any, field: str = "throughput_mb_s") -> float:
    if a is None or b is None:
        return math.nan
    x, y = getattr(a, field), getattr(b, field)
    return x / y if y and not math.isnan(y) else math.nan


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _short_error(error: str | None) -> str:
    first = (error or "").strip().splitlines()[0] if error else ""
    return "FAILED " + (first[:70] + "..." if len(first) > 70 else first)


def core_rows(records: Sequence[Any]) -> list[list[str]]:
    """One row per core/serve record: method, size, callers, MB/s, p50, p99, x gRPC, x tsc, path."""
    index = _index(records)
    rows = []
    for r in records:
        if r.group in ("data", "app"):
            continue
        base_name = "serve-grpc" if r.group == "serve" else BASE
        base = index.get((base_name, r.payload_bytes, r.concurrency))
        comp = index.get((COMPETITOR, r.payload_bytes, r.concurrency)) if r.group == "core" else None
        rows.append(
            [
                r.method,
                size_label(r.payload_bytes),
                str(r.concurrency),
                _fmt(r.throughput_mb_s),
                _fmt(r.p50_ms, 2),
                _fmt(r.p99_ms, 2),
                _fmt(_ratio(r, base), 2) if r.ok else "-",
                _fmt(_ratio(r, comp), 2) if r.ok else "-",
                ("ok " + r.path).strip() if r.ok else _short_error(r.error),
            ]
        )
    return rows


CORE_HEADER = ["method", "payload", "callers", "MB/s", "p50 ms", "p99 ms", "x gRPC", "x tsc", "check/path"]


def data_rows(records: Sequence[Any]) -> list[list[str]]:
    index = {r.method: r for r in records if r.group == "data" and r.ok}
    rows = []
    for r in records:
        if r.group != "data":
            continue
        base = index.get("data-grpc")
        rows.append(
            [
                r.method,
                _fmt(r.rows_per_s),
                _fmt(r.throughput_mb_s),
                _fmt(r.p50_ms, 1),
                _fmt(r.p99_ms, 1),
                _fmt(_ratio(r, base, "rows_per_s"), 2) if r.ok else "-",
                "ok" if r.ok else _short_error(r.error),
            ]
        )
    return rows


DATA_HEADER = ["method", "rows/s", "MB/s", "batch gap p50 ms", "p99 ms", "x gRPC", "check"]


def app_rows(records: Sequence[Any]) -> list[list[str]]:
    """Your own deployment (deployments/image_app.py over HTTP): requests/s, shm vs gRPC to Triton."""
    index = _index(records)
    rows = []
    for r in records:
        if r.group != "app":
            continue
        base = index.get(("app-image-grpc", r.payload_bytes, r.concurrency))
        rows.append(
            [
                r.method,
                size_label(r.payload_bytes),
                str(r.concurrency),
                _fmt(r.rows_per_s) if r.ok else "-",
                _fmt(r.p50_ms, 2),
                _fmt(r.p99_ms, 2),
                _fmt(_ratio(r, base, "rows_per_s"), 2) if r.ok else "-",
                "ok" if r.ok else _short_error(r.error),
            ]
        )
    return rows


APP_HEADER = ["method", "image", "callers", "req/s", "p50 ms", "p99 ms", "x gRPC", "check"]


def app_table(records: Sequence[Any]) -> str:
    """:func:`app_rows` as a plain-text table."""
    return _text_table(APP_HEADER, app_rows(records))


def targets(records: Sequence[Any]) -> list[tuple[str, str, str]]:
    """(target, measured, met?) for each target of the issue."""
    index = _index(records)
    out: list[tuple[str, str, str]] = []
    sizes = sorted({r.payload_bytes for r in records if r.group == "core"})
    callers = sorted({r.concurrency for r in records if r.group == "core"})

    def worst(method: str, base: str, wanted_sizes: Iterable[int]) -> tuple[float, str]:
        low, where = math.nan, "not measured"
        for size in wanted_sizes:
            for c in callers:
                ratio = _ratio(index.get((method, size, c)), index.get((base, size, c)))
                if not math.isnan(ratio) and not ratio >= low:
                    low, where = ratio, f"{size_label(size)} x{c}"
        return low, where

    def verdict(value: float, goal: float, higher: bool = True) -> str:
        if math.isinf(value) or math.isnan(value):
            return "not measured"
        return "met" if (value >= goal if higher else value <= goal) else "NOT met"

    big = [s for s in sizes if s >= 16 * MB]
    for method in ("ours-views", "ours-inplace", "ours-copy"):
        value, where = worst(method, BASE, big)
        out.append(
            (f"{method} >= 15x gRPC at 16/128 MB", f"min {_fmt(value, 1)}x ({where})", verdict(value, 15))
        )
    for method, goal in (("ours-views", 1.2), ("ours-inplace", 1.2), ("ours-copy", 1.0)):
        value, where = worst(method, COMPETITOR, sizes)
        out.append(
            (
                f"{method} >= {goal}x triton-shm-client, every size",
                f"min {_fmt(value, 2)}x ({where})",
                verdict(value, goal),
            )
        )
    small = min(sizes) if sizes else 0
    lat = _ratio(index.get(("ours-copy", small, 1)), index.get((BASE, small, 1)), "p50_ms")
    out.append(
        (f"ours-copy p50 <= 1.1x gRPC at {size_label(small)}", f"{_fmt(lat, 2)}x", verdict(lat, 1.1, False))
    )
    for c in sorted({r.concurrency for r in records if r.group == "serve"}):
        ratio = _ratio(index.get(("serve-ours", 16 * MB, c)), index.get(("serve-grpc", 16 * MB, c)))
        out.append((f"Serve 16 MB >= 5x Serve+gRPC (x{c})", f"{_fmt(ratio, 2)}x", verdict(ratio, 5)))
        slot = index.get(("serve-slotref", 16 * MB, c))
        if slot is not None:  # issue 18: >= 10x Serve + gRPC, within 1.5x of ours-inplace
            ratio = _ratio(slot, index.get(("serve-grpc", 16 * MB, c)))
            out.append(
                (f"Serve slot refs 16 MB >= 10x Serve+gRPC (x{c})", f"{_fmt(ratio, 2)}x", verdict(ratio, 10))
            )
            ratio = _ratio(index.get(("ours-inplace", 16 * MB, c)), slot)
            out.append(
                (
                    f"ours-inplace <= 1.5x Serve slot refs 16 MB (x{c})",
                    f"{_fmt(ratio, 2)}x",
                    verdict(ratio, 1.5, False),
                )
            )
    data = {r.method: r for r in records if r.group == "data" and r.ok}
    if data:
        ratio = _ratio(data.get("data-ours"), data.get("data-grpc"), "rows_per_s")
        out.append(
            ("Ray Data image rows >= 3x gRPC predictor", f"{_fmt(ratio, 2)}x rows/s", verdict(ratio, 3))
        )
    return out


OURS = ("ours-copy", "ours-views", "ours-inplace", "ours-inplace-grpc")


def native_targets(records: Sequence[Any]) -> list[tuple[str, str, str]]:
    """(target, measured, met?) for the native server's targets (issue 16), one server's records."""
    index = _index(records)
    out: list[tuple[str, str, str]] = []
    core = [r for r in records if r.group == "core"]
    sizes = sorted({r.payload_bytes for r in core})
    callers = sorted({r.concurrency for r in core})

    def verdict(value: float, goal: float, higher: bool = True) -> str:
        if math.isinf(value) or math.isnan(value):
            return "not measured"
        return "met" if (value >= goal if higher else value <= goal) else "NOT met"

    def one(method: str, base: str, size: int) -> float:
        return _ratio(index.get((method, size, 1)), index.get((base, size, 1)))

    for size, goal in ((128 * MB, 0.7), (16 * MB, 0.4)):
        value = one("ours-inplace", "memcpy", size)
        out.append(
            (
                f"ours-inplace >= {goal:.0%} of memcpy at {size_label(size)}, 1 caller",
                f"{_fmt(100 * value, 1)}%",
                verdict(value, goal),
            )
        )
    for method, goal in (("ours-inplace", 40), ("ours-copy", 20)):
        value = one(method, BASE, 16 * MB)
        out.append(
            (f"{method} >= {goal}x gRPC at 16 MB, 1 caller", f"{_fmt(value, 1)}x", verdict(value, goal))
        )
    for method, goal in (("ours-views", 1.4), ("ours-inplace", 2.5)):
        for size in (16 * MB, 128 * MB):
            low, where = math.nan, "not measured"
            for c in callers:
                ratio = _ratio(index.get((method, size, c)), index.get((COMPETITOR, size, c)))
                if not math.isnan(ratio) and not ratio >= low:
                    low, where = ratio, f"x{c}"
            out.append(
                (
                    f"{method} >= {goal}x triton-shm-client at {size_label(size)}",
                    f"min {_fmt(low, 2)}x ({where})",
                    verdict(low, goal),
                )
            )
    low, where = math.nan, "not measured"
    for method in OURS:
        for size in sizes:
            for c in callers:
                ratio = _ratio(index.get((method, size, c)), index.get((COMPETITOR, size, c)))
                if not math.isnan(ratio) and not ratio >= low:
                    low, where = ratio, f"{method} {size_label(size)} x{c}"
    out.append(
        (
            "no method of ours below triton-shm-client, any cell",
            f"min {_fmt(low, 2)}x ({where})",
            verdict(low, 1.0),
        )
    )
    small = min(sizes) if sizes else 0
    for method in ("ours-copy", "ours-inplace"):
        lat = _ratio(index.get((method, small, 1)), index.get((BASE, small, 1)), "p50_ms")
        out.append(
            (
                f"{method} p50 <= gRPC p50 at {size_label(small)}, 1 caller",
                f"{_fmt(lat, 2)}x",
                verdict(lat, 1.0, False),
            )
        )
    for c in sorted({r.concurrency for r in records if r.group == "serve"}):
        size = max(r.payload_bytes for r in records if r.group == "serve")
        ours = index.get(("serve-ours", size, c))
        echo = _ratio(ours, index.get(("serve-echo", size, c)))
        grpc = _ratio(ours, index.get(("serve-grpc", size, c)))
        out.append(
            (
                f"Serve handle {size_label(size)} x{c}: bound by the handle round trip",
                f"{_fmt(echo, 2)}x serve-echo, {_fmt(grpc, 2)}x serve-grpc",
                "see note",
            )
        )
    data = {r.method: r for r in records if r.group == "data" and r.ok}
    if data:
        local = _ratio(data.get("data-ours"), data.get("data-local"), "rows_per_s")
        grpc = _ratio(data.get("data-ours"), data.get("data-grpc"), "rows_per_s")
        out.append(
            (
                "Ray Data rows: bound by Ray Data's own per-batch cost",
                f"{_fmt(local, 2)}x data-local, {_fmt(grpc, 2)}x data-grpc",
                "see note",
            )
        )
    return out


PROFILE_HEADER = [
    "payload",
    "method",
    "total ms",
    "client+transport ms",
    "server ms",
    "queue",
    "input",
    "backend",
    "output",
    "memcpy ms",
]


def profile_rows(profiles: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The per-request profile (see :mod:`ray_triton_shm._private.bench.profile`), one server's rows."""
    rows = []
    for p in profiles:
        if "payload_bytes" not in p:
            rows.append(["-", "-", "FAILED " + str(p.get("error", ""))[:70]] + ["-"] * 7)
            continue
        if p.get("error"):
            rows.append(
                [size_label(p["payload_bytes"]), p["method"], "FAILED " + p["error"][:70]] + ["-"] * 7
            )
            continue
        rows.append(
            [size_label(p["payload_bytes"]), p["method"]]
            + [
                _fmt(p[key], 3)
                for key in (
                    "total_ms",
                    "client_transport_ms",
                    "server_ms",
                    "queue_ms",
                    "input_ms",
                    "backend_ms",
                    "output_ms",
                    "memcpy_ms",
                )
            ]
        )
    return rows


def memcpy_rows(records: Sequence[Any]) -> list[list[str]]:
    """How close the shm methods come to the memcpy of the same payload (1 caller)."""
    index = _index(records)
    rows = []
    for size in sorted({r.payload_bytes for r in records if r.group == "core"}):
        ref = index.get(("memcpy", size, 1))
        if ref is None:
            continue
        row = [size_label(size), _fmt(ref.throughput_mb_s)]
        for method in ("ours-inplace", "ours-views", "ours-copy", COMPETITOR, BASE):
            row.append(_fmt(100 * _ratio(index.get((method, size, 1)), ref), 1))
        rows.append(row)
    return rows


MEMCPY_HEADER = ["payload", "memcpy MB/s", "in-place %", "views %", "copy %", "tsc %", "gRPC %"]


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = (
        [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    )
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _info_lines(info: dict[str, Any]) -> list[str]:
    return [f"{k}: {v}" for k, v in info.items()]


def _servers(records: Sequence[Any]) -> list[str]:
    from ray_triton_shm._private.bench.servers import SERVERS

    present = {getattr(r, "server", "python") for r in records}
    return [name for name in SERVERS if name in present] + sorted(present - set(SERVERS))


def _title(server: str) -> str:
    from ray_triton_shm._private.bench.servers import SERVERS

    return SERVERS[server].title if server in SERVERS else server


def _of(records: Sequence[Any], server: str) -> list[Any]:
    return [r for r in records if getattr(r, "server", "python") == server]


def _server_targets(server: str, records: Sequence[Any]) -> list[tuple[str, str, str]]:
    return native_targets(records) if server == "native" else targets(records)


def render(records: Sequence[Any], info: dict[str, Any], profiles: Sequence[dict[str, Any]] = ()) -> str:
    """The plain-text report printed at the end of a run: the native server's tables first."""
    parts = ["\n".join(_info_lines(info))]
    for server in _servers(records):
        mine = _of(records, server)
        parts.append(f"== {server}: {_title(server)} ==")
        parts.append(_text_table(CORE_HEADER, core_rows(mine)))
        if any(r.group == "data" for r in mine):
            parts.append(_text_table(DATA_HEADER, data_rows(mine)))
        if any(r.group == "app" for r in mine):
            parts.append(app_table(mine))
        parts.append(_text_table(MEMCPY_HEADER, memcpy_rows(mine)))
        prof = [p for p in profiles if p.get("server") == server]
        if prof:
            parts.append(_text_table(PROFILE_HEADER, profile_rows(prof)))
        parts.append(
            _text_table(["target", "measured", "verdict"], [list(t) for t in _server_targets(server, mine)])
        )
    return "\n\n".join(parts)


def markdown(
    records: Sequence[Any],
    info: dict[str, Any],
    plots: Sequence[Path],
    profiles: Sequence[dict[str, Any]] = (),
) -> str:
    """The report as markdown, ready to paste into docs/benchmarks.md: one section per server."""
    parts = ["## Run", "\n".join(f"- {line}" for line in _info_lines(info))]
    for server in _servers(records):
        mine = _of(records, server)
        model = "identity_native" if server == "native" else "identity"
        parts += [
            f"## {server.capitalize()} server: {_title(server)}",
            f"### Targets ({server})",
            _md_table(["target", "measured", "verdict"], [list(t) for t in _server_targets(server, mine)]),
            f"### Core methods ({server}: `{model}` model, one Triton)",
            "`x gRPC` and `x tsc` are throughput ratios against plain `tritonclient.grpc` and "
            "`triton-shm-client` at the same payload and caller count.",
            _md_table(CORE_HEADER, core_rows(mine)),
            f"### Distance to memcpy ({server}: 1 caller, % of memcpy throughput)",
            _md_table(MEMCPY_HEADER, memcpy_rows(mine)),
        ]
        prof = [p for p in profiles if p.get("server") == server]
        if prof:
            parts += [
                f"### Where a request's time goes ({server}: 1 caller, mean ms per request)",
                "`server` is Triton's own time per request (its statistics), split into queue, "
                "input (the backend getting its buffers), backend (the model itself) and output; "
                "`client+transport` is the caller's clock minus it.",
                _md_table(PROFILE_HEADER, profile_rows(prof)),
            ]
        if any(r.group == "data" for r in mine):
            parts += [
                f"### Ray Data ({server}: multi_io, 3x224x224 FP32 rows)",
                _md_table(DATA_HEADER, data_rows(mine)),
            ]
        if any(r.group == "app" for r in mine):
            parts += [
                f"### Your own deployment ({server}: deployments/image_app.py over HTTP, PNG in, JSON out)",
                "The same Serve app writing the decoded image into a leased slot (`shm`) or sending "
                "it to the same Triton with `tritonclient.grpc` (`grpc`); `x gRPC`: ratio of requests/s.",
                _md_table(APP_HEADER, app_rows(mine)),
            ]
    if plots:
        parts += ["## Plots", "\n".join(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n\n".join(parts) + "\n"


def plot(records: Sequence[Any], out_dir: Path) -> list[Path]:
    """Throughput and p50 latency vs payload, one line per method, one panel per caller count.

    Returns:
        The PNG files written (none if matplotlib is missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install '.[bench]')")
        return []
    files = []
    for server in _servers(records):
        files += _plot_server(plt, _of(records, server), out_dir, server)
    return files


def _plot_server(plt: Any, records: Sequence[Any], out_dir: Path, server: str) -> list[Path]:
    core = [r for r in records if r.ok and r.group in ("core", "serve")]
    callers = sorted({r.concurrency for r in core})
    methods = list(dict.fromkeys(r.method for r in core))
    files = []
    for field, ylabel, name in (
        ("throughput_mb_s", "throughput (MB/s, input bytes)", f"throughput-{server}.png"),
        ("p50_ms", "p50 latency (ms)", f"latency-{server}.png"),
    ):
        fig, axes = plt.subplots(1, len(callers), figsize=(5.2 * len(callers), 4.4), squeeze=False)
        for ax, c in zip(axes[0], callers):
            for method in methods:
                points = sorted(
                    (r.payload_bytes, getattr(r, field))
                    for r in core
                    if r.method == method and r.concurrency == c
                )
                if len(points) < 1:
                    continue
                style = "--" if method.startswith("serve") else ("-." if method == "memcpy" else "-")
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", ms=3, label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{server} server, {c} caller{'s' if c > 1 else ''}")
            ax.set_xlabel("payload per request (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files
