"""A run's report from its records: plain text, markdown and plots, one part per server.

The tables' rows are built in :mod:`.tables`, the targets checked in :mod:`.targets`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_triton_shm._private.bench.servers import SERVERS
from ray_triton_shm._private.bench.tables import (
    APP_HEADER,
    CORE_HEADER,
    DATA_HEADER,
    MEMCPY_HEADER,
    PROFILE_HEADER,
    app_rows,
    core_rows,
    data_rows,
    md_table,
    memcpy_rows,
    profile_rows,
    text_table,
)
from ray_triton_shm._private.bench.targets import native_targets, targets

logger = logging.getLogger(__name__)


def app_table(records: Sequence[Any]) -> str:
    """:func:`app_rows` as a plain-text table."""
    return text_table(APP_HEADER, app_rows(records))


def _info_lines(info: dict[str, Any]) -> list[str]:
    return [f"{k}: {v}" for k, v in info.items()]


def _servers(records: Sequence[Any]) -> list[str]:
    present = {getattr(r, "server", "python") for r in records}
    return [name for name in SERVERS if name in present] + sorted(present - set(SERVERS))


def _title(server: str) -> str:
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
        parts.append(text_table(CORE_HEADER, core_rows(mine)))
        if any(r.group == "data" for r in mine):
            parts.append(text_table(DATA_HEADER, data_rows(mine)))
        if any(r.group == "app" for r in mine):
            parts.append(app_table(mine))
        parts.append(text_table(MEMCPY_HEADER, memcpy_rows(mine)))
        prof = [p for p in profiles if p.get("server") == server]
        if prof:
            parts.append(text_table(PROFILE_HEADER, profile_rows(prof)))
        parts.append(
            text_table(["target", "measured", "verdict"], [list(t) for t in _server_targets(server, mine)])
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
            md_table(["target", "measured", "verdict"], [list(t) for t in _server_targets(server, mine)]),
            f"### Core methods ({server}: `{model}` model, one Triton)",
            "`x gRPC` and `x tsc` are throughput ratios against plain `tritonclient.grpc` and "
            "`triton-shm-client` at the same payload and caller count.",
            md_table(CORE_HEADER, core_rows(mine)),
            f"### Distance to memcpy ({server}: 1 caller, % of memcpy throughput)",
            md_table(MEMCPY_HEADER, memcpy_rows(mine)),
        ]
        prof = [p for p in profiles if p.get("server") == server]
        if prof:
            parts += [
                f"### Where a request's time goes ({server}: 1 caller, mean ms per request)",
                "`server` is Triton's own time per request (its statistics), split into queue, "
                "input (the backend getting its buffers), backend (the model itself) and output; "
                "`client+transport` is the caller's clock minus it.",
                md_table(PROFILE_HEADER, profile_rows(prof)),
            ]
        if any(r.group == "data" for r in mine):
            parts += [
                f"### Ray Data ({server}: multi_io, 3x224x224 FP32 rows)",
                md_table(DATA_HEADER, data_rows(mine)),
            ]
        if any(r.group == "app" for r in mine):
            parts += [
                f"### Your own deployment ({server}: deployments/image_app.py over HTTP, PNG in, JSON out)",
                "The same Serve app writing the decoded image into a leased slot (`shm`) or sending "
                "it to the same Triton with `tritonclient.grpc` (`grpc`); `x gRPC`: ratio of requests/s.",
                md_table(APP_HEADER, app_rows(mine)),
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
        import matplotlib  # lazy: matplotlib is optional (the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: as above
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
