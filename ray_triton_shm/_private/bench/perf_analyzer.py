"""Triton's own load generator, ``perf_analyzer``, run unchanged as a caller of any KServe v2 endpoint.

The binary comes from the tritonclient 2.49.0 manylinux wheel
(``tritonclient-2.49.0.data/data/bin/perf_analyzer``); ``make peers`` puts it in
``.cache/peers/bin`` and the ``libcudart.so.12`` it links against (from the
``nvidia-cuda-runtime-cu12`` wheel) in ``.cache/peers/cuda``; it also needs
Debian's ``libb64-0d``. It is never part of this package: :func:`find_binary`
looks for it in ``$RAY_TRITON_SHM_PERF_ANALYZER``, then in ``.cache/peers/bin``
of the source tree, then on ``PATH``.

A run (:func:`run`) sends the tensors of an ``--input-data`` JSON file (see
:func:`write_input_data`) over HTTP or gRPC with a fixed number of callers, in
count windows (``--measurement-mode count_windows``: each window lasts until
``window_requests`` requests are done, so slow and fast paths are measured over
the same work), at most ``max_windows`` of them (``-r``) until the last three
agree within ``stability_percent`` (``-s``), and reports throughput and latency
from its CSV (``-f``) and its request count from its own output. A run's length
is bounded by ``timeout_s``.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ray_triton_shm.errors import RayTritonShmError

ENV_BINARY = "RAY_TRITON_SHM_PERF_ANALYZER"
"""The perf_analyzer binary to run (overrides ``.cache/peers/bin/perf_analyzer``)."""
ENV_LIBRARIES = "RAY_TRITON_SHM_PERF_ANALYZER_LIBS"
"""Directories (``os.pathsep``-separated) put first on the binary's ``LD_LIBRARY_PATH``."""
PEERS_DIR = Path(__file__).resolve().parents[3] / ".cache" / "peers"
"""Where ``make peers`` installs the programs the tests and the benchmark run against."""
CUDART = "libcudart.so.12"
PROTOCOLS = ("http", "grpc")
_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.uint8): "UINT8"}


class PerfAnalyzerError(RayTritonShmError):
    """perf_analyzer is missing, failed, timed out, or reported something unreadable.

    Attributes:
        output: What it printed (stdout and stderr), if it ran.
    """

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message, output)
        self.message = message
        self.output = output

    def __str__(self) -> str:
        tail = self.output.strip()[-2000:]
        return f"{self.message}\n{tail}" if tail else self.message


class PerfAnalyzerMissingError(PerfAnalyzerError):
    """No perf_analyzer binary where it is looked for (``make peers`` installs it)."""


@dataclass(frozen=True, kw_only=True)
class PerfAnalyzerRun:
    """One perf_analyzer run: ``concurrency`` callers calling ``url`` in count windows.

    Attributes:
        protocol: ``http`` or ``grpc``.
        url: ``host:port`` of the endpoint.
        model: The model name.
        input_data: The ``--input-data`` JSON file (:func:`write_input_data`).
        concurrency: Requests in flight at once (``--concurrency-range N:N``).
        window_requests: Requests per measurement window at least (``--measurement-request-count``).
        max_windows: Windows at most (``-r``); perf_analyzer fails if the last three never agree.
        stability_percent: How far apart (max / min, in percent) the last three windows'
            throughput and latency may be (``-s``); the result is their average.
        timeout_s: The run is killed after this long and counts as failed.
        extra_args: More command-line arguments, appended as given.
    """

    protocol: str
    url: str
    model: str
    input_data: Path
    concurrency: int = 1
    window_requests: int = 50
    max_windows: int = 10
    stability_percent: float = 10.0
    timeout_s: float = 120.0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.window_requests < self.concurrency:
            raise ValueError(
                f"window_requests ({self.window_requests}) must be >= concurrency ({self.concurrency})"
            )
        if self.max_windows < 3:
            raise ValueError(f"max_windows must be >= 3 (stability compares three), got {self.max_windows}")
        if not self.stability_percent > 0:
            raise ValueError(f"stability_percent must be > 0, got {self.stability_percent}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class PerfAnalyzerResult:
    """What one run measured.

    Attributes:
        throughput: Inferences per second over the measured requests.
        requests: Requests the client counted in its measurement (the windows reported).
        p50_us / p90_us / p99_us: Client-side latency percentiles, microseconds.
        output: What it printed.
    """

    throughput: float
    requests: int
    p50_us: float
    p90_us: float
    p99_us: float
    output: str = ""


def find_binary(environ: Mapping[str, str] | None = None, peers_dir: Path = PEERS_DIR) -> Path:
    """The perf_analyzer to run: ``$RAY_TRITON_SHM_PERF_ANALYZER``, ``.cache/peers/bin``, ``PATH``.

    Raises:
        PerfAnalyzerMissingError: The variable names no executable file, or none is found.
    """
    env = os.environ if environ is None else environ
    named = env.get(ENV_BINARY)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PerfAnalyzerMissingError(f"${ENV_BINARY}={named} is not an executable file")
        return path
    local = peers_dir / "bin" / "perf_analyzer"
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which("perf_analyzer", path=env.get("PATH"))
    if found:
        return Path(found)
    raise PerfAnalyzerMissingError(
        f"perf_analyzer not found (${ENV_BINARY}, {local}, PATH): `make peers` installs it"
    )


def library_path(binary: Path, environ: Mapping[str, str] | None = None, peers_dir: Path = PEERS_DIR) -> str:
    """The ``LD_LIBRARY_PATH`` to run ``binary`` with: where a ``libcudart.so.12`` is, then the caller's.

    Looked for in ``$RAY_TRITON_SHM_PERF_ANALYZER_LIBS``, then in a ``cuda`` directory
    beside the binary's ``bin`` (as ``make peers`` lays them out), then in
    ``.cache/peers/cuda``; directories that do not exist are left out.
    """
    env = os.environ if environ is None else environ
    dirs = [Path(d) for d in env.get(ENV_LIBRARIES, "").split(os.pathsep) if d]
    for root in (binary.resolve().parent.parent / "cuda", peers_dir / "cuda"):
        if root.is_dir():
            dirs.extend(sorted({p.parent for p in root.rglob(CUDART)}))
    parts: list[str] = []
    for d in dirs:
        if d.is_dir() and str(d) not in parts:
            parts.append(str(d))
    parts.extend(p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in parts)
    return os.pathsep.join(parts)


def write_input_data(path: Path, tensors: Mapping[str, np.ndarray]) -> Path:
    """An ``--input-data`` JSON file sending ``tensors`` (one request's, without the batch dimension).

    Each tensor goes in base64 with its shape, as perf_analyzer reads it.

    Raises:
        ValueError: A tensor's dtype is not one this writer maps to a Triton type.
    """
    entry = {}
    for name, array in tensors.items():
        if array.dtype not in _DTYPES:
            raise ValueError(
                f"{name}: dtype {array.dtype} not supported (one of {sorted(map(str, _DTYPES))})"
            )
        raw = np.ascontiguousarray(array).tobytes()
        entry[name] = {"b64": base64.b64encode(raw).decode("ascii"), "shape": list(array.shape)}
    path.write_text(json.dumps({"data": [entry]}))
    return path


def command(binary: Path, spec: PerfAnalyzerRun, csv_path: Path) -> list[str]:
    """The command line of ``spec``, writing its CSV report to ``csv_path``."""
    return [
        str(binary),
        "-m",
        spec.model,
        "-i",
        spec.protocol,
        "-u",
        spec.url,
        "--input-data",
        str(spec.input_data),
        "--concurrency-range",
        f"{spec.concurrency}:{spec.concurrency}",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(spec.window_requests),
        "-r",
        str(spec.max_windows),
        "-s",
        f"{spec.stability_percent:g}",
        "-f",
        str(csv_path),
        *spec.extra_args,
    ]


_REQUEST_COUNT = re.compile(r"^\s*Request count:\s*(\d+)\s*$", re.MULTILINE)
_ERROR_LINE = re.compile(r"\berror\b|\bfailed\b", re.IGNORECASE)


def error_lines(output: str) -> list[str]:
    """The lines of perf_analyzer's output that report an error or a failure."""
    return [line.strip() for line in output.splitlines() if _ERROR_LINE.search(line)]


def parse_report(csv_text: str, output: str, concurrency: int) -> PerfAnalyzerResult:
    """A run's result from its CSV report and its printed output.

    Raises:
        PerfAnalyzerError: No row for ``concurrency``, a column missing, or no request count printed.
    """
    rows = [r for r in csv.DictReader(io.StringIO(csv_text)) if r.get("Concurrency", "").strip()]
    row = next((r for r in rows if r["Concurrency"].strip() == str(concurrency)), None)
    if row is None:
        raise PerfAnalyzerError(f"its CSV has no row for concurrency {concurrency}", csv_text)
    counts = _REQUEST_COUNT.findall(output)
    if not counts:
        raise PerfAnalyzerError("its output has no 'Request count' line", output)
    try:
        return PerfAnalyzerResult(
            throughput=float(row["Inferences/Second"]),
            requests=int(counts[-1]),
            p50_us=float(row["p50 latency"]),
            p90_us=float(row["p90 latency"]),
            p99_us=float(row["p99 latency"]),
            output=output,
        )
    except (KeyError, ValueError) as e:
        raise PerfAnalyzerError(f"its CSV lacks or garbles a column: {e}", csv_text) from e


def run(spec: PerfAnalyzerRun, binary: Path | None = None) -> PerfAnalyzerResult:
    """Run perf_analyzer as ``spec`` says and read what it measured.

    Raises:
        PerfAnalyzerMissingError: No binary (``make peers``).
        PerfAnalyzerError: It exited non-zero, reported an error, timed out, or measured nothing.
    """
    binary = binary or find_binary()
    env = dict(os.environ, LD_LIBRARY_PATH=library_path(binary))
    with tempfile.TemporaryDirectory(prefix="rtshm-pa-") as tmp:
        csv_path = Path(tmp) / "report.csv"
        try:
            done = subprocess.run(
                command(binary, spec, csv_path),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=spec.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            raise PerfAnalyzerError(
                f"perf_analyzer ran past {spec.timeout_s:g} s against {spec.url}", out
            ) from e
        output = done.stdout
        if done.returncode != 0:
            raise PerfAnalyzerError(f"perf_analyzer exited with {done.returncode} against {spec.url}", output)
        errors = error_lines(output)
        if errors:
            raise PerfAnalyzerError(f"perf_analyzer reported: {errors[0]}", output)
        if not csv_path.is_file():
            raise PerfAnalyzerError("perf_analyzer wrote no CSV report", output)
        result = parse_report(csv_path.read_text(), output, spec.concurrency)
    if not result.throughput > 0 or result.requests < 1:
        raise PerfAnalyzerError(f"perf_analyzer measured nothing against {spec.url}", output)
    return result
