"""The benchmark's tables: rows of strings from its records, as plain text or markdown."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

KB = 1024
MB = 1024 * KB
BASE = "grpc"
COMPETITOR = "triton-shm-client"


def size_label(size: int) -> str:
    """``4 KB``, ``16 MB``, ``100 B``: a payload size for people."""
    if size >= MB:
        return f"{size / MB:g} MB"
    return f"{size / KB:g} KB" if size >= KB else f"{size} B"


def by_cell(records: Iterable[Any]) -> dict[tuple[str, int, int], Any]:
    """The records that succeeded, by (method, payload bytes, callers)."""
    return {(r.method, r.payload_bytes, r.concurrency): r for r in records if r.ok}


def ratio_of(a: Any, b: Any, field: str = "throughput_mb_s") -> float:
    """``a``'s ``field`` over ``b``'s; NaN when either is missing or ``b``'s is 0 or NaN."""
    if a is None or b is None:
        return math.nan
    x, y = getattr(a, field), getattr(b, field)
    return x / y if y and not math.isnan(y) else math.nan


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals and thousands separators; ``-`` for none or NaN."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def short_error(error: str | None) -> str:
    """``FAILED`` and the first line of ``error``, cut to 70 characters."""
    first = (error or "").strip().splitlines()[0] if error else ""
    return "FAILED " + (first[:70] + "..." if len(first) > 70 else first)


def core_rows(records: Sequence[Any]) -> list[list[str]]:
    """One row per core/serve record: method, size, callers, MB/s, p50, p99, x gRPC, x tsc, path."""
    index = by_cell(records)
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
                fmt(r.throughput_mb_s),
                fmt(r.p50_ms, 2),
                fmt(r.p99_ms, 2),
                fmt(ratio_of(r, base), 2) if r.ok else "-",
                fmt(ratio_of(r, comp), 2) if r.ok else "-",
                ("ok " + r.path).strip() if r.ok else short_error(r.error),
            ]
        )
    return rows


CORE_HEADER = ["method", "payload", "callers", "MB/s", "p50 ms", "p99 ms", "x gRPC", "x tsc", "check/path"]


def data_rows(records: Sequence[Any]) -> list[list[str]]:
    """One row per Ray Data record: method, rows/s, MB/s, batch gaps p50/p99, x gRPC (rows/s)."""
    index = {r.method: r for r in records if r.group == "data" and r.ok}
    rows = []
    for r in records:
        if r.group != "data":
            continue
        base = index.get("data-grpc")
        rows.append(
            [
                r.method,
                fmt(r.rows_per_s),
                fmt(r.throughput_mb_s),
                fmt(r.p50_ms, 1),
                fmt(r.p99_ms, 1),
                fmt(ratio_of(r, base, "rows_per_s"), 2) if r.ok else "-",
                "ok" if r.ok else short_error(r.error),
            ]
        )
    return rows


DATA_HEADER = ["method", "rows/s", "MB/s", "batch gap p50 ms", "p99 ms", "x gRPC", "check"]


def app_rows(records: Sequence[Any]) -> list[list[str]]:
    """Your own deployment (deployments/image_app.py over HTTP): requests/s, shm vs gRPC to Triton."""
    index = by_cell(records)
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
                fmt(r.rows_per_s) if r.ok else "-",
                fmt(r.p50_ms, 2),
                fmt(r.p99_ms, 2),
                fmt(ratio_of(r, base, "rows_per_s"), 2) if r.ok else "-",
                "ok" if r.ok else short_error(r.error),
            ]
        )
    return rows


APP_HEADER = ["method", "image", "callers", "req/s", "p50 ms", "p99 ms", "x gRPC", "check"]


def app_table(records: Sequence[Any]) -> str:
    """:func:`app_rows` as a plain-text table."""
    return text_table(APP_HEADER, app_rows(records))


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
                fmt(p[key], 3)
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
    index = by_cell(records)
    rows = []
    for size in sorted({r.payload_bytes for r in records if r.group == "core"}):
        ref = index.get(("memcpy", size, 1))
        if ref is None:
            continue
        row = [size_label(size), fmt(ref.throughput_mb_s)]
        for method in ("ours-inplace", "ours-views", "ours-copy", COMPETITOR, BASE):
            row.append(fmt(100 * ratio_of(index.get((method, size, 1)), ref), 1))
        rows.append(row)
    return rows


MEMCPY_HEADER = ["payload", "memcpy MB/s", "in-place %", "views %", "copy %", "tsc %", "gRPC %"]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` under ``header`` as a plain-text table, columns padded to their widest cell."""
    widths = (
        [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    )
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """``rows`` under ``header`` as a markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
