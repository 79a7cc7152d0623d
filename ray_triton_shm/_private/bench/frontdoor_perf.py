"""The front-door table's callers from perf_analyzer, and what each path's serving processes cost per call.

:class:`PerfAnalyzerCells` runs one perf_analyzer process per cell and round
(see :mod:`.perf_analyzer`): Triton's own C++ load generator, unchanged, whose
callers are threads of one process taking little of the machine's CPU, so the
cores are left to the servers. Each run measures in count windows of the same
payload (``bytes_per_window``, at least ``min_requests`` requests), so a slow
path and a fast one are measured over the same work; three windows by default,
averaged, with perf_analyzer's own stability test off (a shared machine's speed
moves by more than its 10 % from one window to the next: the rounds of a cell,
which rotate the paths, show the spread instead).

A path's **server CPU per call** (:func:`server_cpu_ms`) is the CPU time its
serving processes spent during the cell (:mod:`.cpu_share`, this run's processes
only) over the calls Triton counted for the model meanwhile (every path ends at
Triton, so :class:`TritonCounter` counts every path's calls alike): the Serve
replicas and Triton for the front door, Triton alone for Triton's own endpoint,
the proxy, the replicas and Triton for Serve's proxies.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ray_triton_shm._private.bench import perf_analyzer

SERVER_GROUPS: dict[str, tuple[str, ...]] = {
    "frontdoor": ("replicas", "triton"),
    "direct": ("replicas", "triton"),
    "triton": ("triton",),
    "serve": ("proxy", "replicas", "triton"),
    "haproxy": ("proxy", "replicas", "triton"),
}
"""The process groups (:data:`.cpu_share.GROUPS`) serving each kind of path."""


def server_groups(path: str) -> tuple[str, ...]:
    """The process groups serving ``path`` (``frontdoor-grpc`` -> replicas and Triton).

    Raises:
        ValueError: An unknown kind of path.
    """
    kind = path.rsplit("-", 1)[0]
    if kind not in SERVER_GROUPS:
        raise ValueError(f"unknown path {path!r}; kinds: {sorted(SERVER_GROUPS)}")
    return SERVER_GROUPS[kind]


def server_cpu_ms(path: str, spent_s: dict[str, float], calls: int) -> float:
    """CPU milliseconds per call of ``path``'s serving processes (NaN without calls).

    Args:
        path: The row's path.
        spent_s: CPU seconds by group during the cell (:func:`.cpu_share.cpu_by_group`).
        calls: Calls completed during the cell.
    """
    if calls <= 0:
        return math.nan
    return 1e3 * sum(spent_s.get(group, 0.0) for group in server_groups(path)) / calls


class TritonCounter:
    """The requests Triton has completed for a model (its statistics, over its own HTTP endpoint)."""

    def __init__(self, http_url: str) -> None:
        import tritonclient.http as httpclient  # lazy: only the benchmark needs it

        self._client = httpclient.InferenceServerClient(http_url, network_timeout=60)

    def count(self, model: str) -> int:
        """Successful inference requests of ``model`` (all versions) so far."""
        stats = self._client.get_inference_statistics(model)
        return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])

    def close(self) -> None:
        self._client.close()


@dataclass(frozen=True)
class PerfAnalyzerCell:
    """One cell and round measured by perf_analyzer."""

    calls: int
    mb_s: float
    p50_ms: float
    error: str | None = None
    cpu_s: float = 0.0
    """perf_analyzer's own CPU seconds (user + system), from the rusage of the children reaped."""


class PerfAnalyzerCells:
    """Cells of the front-door table, each a perf_analyzer run of a few count windows.

    Args:
        work: A directory for the input files (one per payload size).
        bytes_per_window: Payload of a measurement window (its requests: this over the size).
        min_requests: Requests per window at least (and at least 2 per caller).
        windows: Windows at most per run (``-r``; 3 when the stability test is off).
        stability_percent: perf_analyzer's stability test (``-s``): how far apart the last
            three windows may be; a run that never gets there fails.
        timeout_s: A run still going after this long fails.

    Raises:
        PerfAnalyzerMissingError: No perf_analyzer binary (``make peers``).
    """

    def __init__(
        self,
        work: Path,
        bytes_per_window: int,
        min_requests: int,
        windows: int = 3,
        stability_percent: float = 1000.0,
        timeout_s: float = 180.0,
    ) -> None:
        self._binary = perf_analyzer.find_binary()
        self._work = work
        self._bytes = bytes_per_window
        self._min = min_requests
        self._windows = windows
        self._stability = stability_percent
        self._timeout_s = timeout_s
        self._inputs: dict[int, Path] = {}

    def window_requests(self, size: int, callers: int) -> int:
        """Requests per measurement window of a cell."""
        return max(self._min, 2 * callers, -(-self._bytes // size))

    def _input(self, size: int) -> Path:
        path = self._inputs.get(size)
        if path is None:
            x = np.random.default_rng(size).random(size // 4, dtype=np.float32)
            path = perf_analyzer.write_input_data(self._work / f"input-{size}.json", {"INPUT0": x})
            self._inputs[size] = path
        return path

    def run(self, protocol: str, urls: list[str], model: str, size: int, callers: int) -> PerfAnalyzerCell:
        """``callers`` in flight against ``urls[0]``: throughput in MB/s (1e6) and p50 latency."""
        spec = perf_analyzer.PerfAnalyzerRun(
            protocol=protocol,
            url=urls[0],
            model=model,
            input_data=self._input(size),
            concurrency=callers,
            window_requests=self.window_requests(size, callers),
            max_windows=self._windows,
            stability_percent=self._stability,
            timeout_s=self._timeout_s,
        )
        before = _children_cpu_s()
        try:
            result = perf_analyzer.run(spec, self._binary)
        except perf_analyzer.PerfAnalyzerError as e:
            return PerfAnalyzerCell(0, math.nan, math.nan, e.message + _last_error(e.output))
        cpu_s = _children_cpu_s() - before
        return PerfAnalyzerCell(
            result.requests, result.throughput * size / 1e6, result.p50_us / 1e3, None, cpu_s
        )


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _last_error(output: str) -> str:
    lines = perf_analyzer.error_lines(output)
    return f": {lines[-1][:200]}" if lines else ""
