"""perf_analyzer as the front-door table's caller: finding it, its command line, reading its report."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm._private.bench import perf_analyzer as pa
from ray_triton_shm.errors import RayTritonShmError

# perf_analyzer 2.49.0's CSV (-f) and the tail of its output, from a run against Triton's gRPC endpoint.
CSV = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
    "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
    "p50 latency,p90 latency,p95 latency,p99 latency\n"
    "8,299.846,490,20317,412,199,114,787,40,21430,36190,40535,46576"
)
OUTPUT = """Request concurrency: 8
  Client:
    Request count: 300
    Throughput: 299.846 infer/sec
    p50 latency: 21430 usec
  Server:
    Inference count: 300
"""


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_variable_comes_first_then_the_peers_directory_then_path(tmp_path: Path) -> None:
    named = _executable(tmp_path / "elsewhere" / "pa")
    local = _executable(tmp_path / "peers" / "bin" / "perf_analyzer")
    on_path = _executable(tmp_path / "path" / "perf_analyzer")
    env = {pa.ENV_BINARY: str(named), "PATH": str(on_path.parent)}
    assert pa.find_binary(env, tmp_path / "peers") == named
    assert pa.find_binary({"PATH": str(on_path.parent)}, tmp_path / "peers") == local
    assert pa.find_binary({"PATH": str(on_path.parent)}, tmp_path / "none") == on_path


def test_missing_or_not_executable_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(pa.PerfAnalyzerMissingError, match="make peers"):
        pa.find_binary({"PATH": str(tmp_path)}, tmp_path)
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(pa.PerfAnalyzerMissingError, match="not an executable"):
        pa.find_binary({pa.ENV_BINARY: str(plain)}, tmp_path)
    assert issubclass(pa.PerfAnalyzerMissingError, RayTritonShmError)


def test_library_path_finds_libcudart_beside_the_binary_and_keeps_the_callers(tmp_path: Path) -> None:
    binary = _executable(tmp_path / "peers" / "bin" / "perf_analyzer")
    lib = tmp_path / "peers" / "cuda" / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    (lib / pa.CUDART).write_bytes(b"")
    extra = tmp_path / "extra"
    extra.mkdir()
    env = {pa.ENV_LIBRARIES: f"{extra}{os.pathsep}{tmp_path / 'gone'}", "LD_LIBRARY_PATH": "/usr/local/lib"}
    assert pa.library_path(binary, env, tmp_path / "nowhere").split(os.pathsep) == [
        str(extra),
        str(lib),
        "/usr/local/lib",
    ]


def test_input_data_holds_the_tensor_in_base64_with_its_shape(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = pa.write_input_data(tmp_path / "in.json", {"INPUT0": x})
    entry = json.loads(path.read_text())["data"][0]["INPUT0"]
    assert entry["shape"] == [3, 4]
    back = np.frombuffer(base64.b64decode(entry["b64"]), dtype=np.float32).reshape(3, 4)
    assert np.array_equal(back, x)
    with pytest.raises(ValueError, match="float64"):
        pa.write_input_data(tmp_path / "bad.json", {"INPUT0": np.zeros(2)})


def test_command_line_uses_count_windows_and_the_csv_report(tmp_path: Path) -> None:
    spec = pa.PerfAnalyzerRun(
        protocol="grpc",
        url="127.0.0.1:9001",
        model="identity",
        input_data=tmp_path / "in.json",
        concurrency=8,
        window_requests=64,
        max_windows=4,
        stability_percent=25,
    )
    cmd = pa.command(Path("/bin/pa"), spec, tmp_path / "r.csv")
    text = " ".join(cmd)
    assert cmd[0] == "/bin/pa"
    for part in (
        "-m identity",
        "-i grpc",
        "-u 127.0.0.1:9001",
        f"--input-data {tmp_path / 'in.json'}",
        "--concurrency-range 8:8",
        "--measurement-mode count_windows",
        "--measurement-request-count 64",
        "-r 4",
        "-s 25",
        f"-f {tmp_path / 'r.csv'}",
    ):
        assert part in text, part


@pytest.mark.parametrize(
    "change",
    [
        {"protocol": "tcp"},
        {"concurrency": 0},
        {"window_requests": 4},  # fewer than the 8 callers
        {"max_windows": 2},
        {"stability_percent": 0},
        {"timeout_s": 0},
    ],
)
def test_a_run_refuses_what_perf_analyzer_cannot_do(change: dict, tmp_path: Path) -> None:
    args = {"protocol": "http", "url": "h:1", "model": "m", "input_data": tmp_path, "concurrency": 8}
    with pytest.raises(ValueError):
        pa.PerfAnalyzerRun(**{**args, **change})


def test_the_report_gives_throughput_latency_and_requests() -> None:
    result = pa.parse_report(CSV, OUTPUT, 8)
    assert result.throughput == pytest.approx(299.846)
    assert result.requests == 300
    assert (result.p50_us, result.p90_us, result.p99_us) == (21430, 36190, 46576)


def test_a_report_without_the_row_or_the_count_is_an_error() -> None:
    with pytest.raises(pa.PerfAnalyzerError, match="concurrency 1"):
        pa.parse_report(CSV, OUTPUT, 1)
    with pytest.raises(pa.PerfAnalyzerError, match="Request count"):
        pa.parse_report(CSV, "Throughput: 1 infer/sec", 8)
    with pytest.raises(pa.PerfAnalyzerError, match="column"):
        pa.parse_report(CSV.replace("p50 latency", "p5O"), OUTPUT, 8)


def test_error_lines_pick_what_perf_analyzer_reports_as_failures() -> None:
    out = OUTPUT + "Thread [3] had error: failed to connect\nFailed to obtain stable measurement.\n"
    assert pa.error_lines(out) == [
        "Thread [3] had error: failed to connect",
        "Failed to obtain stable measurement.",
    ]
    assert pa.error_lines(OUTPUT) == []


def _fake(tmp_path: Path, body: str) -> Path:
    """A stand-in binary that runs ``body`` with perf_analyzer's arguments (-f FILE among them)."""
    return _executable(
        tmp_path / "fake_pa",
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -f ] && csv="$2"; shift; done\n' + body,
    )


def _spec(tmp_path: Path, **kw) -> pa.PerfAnalyzerRun:
    args = {"protocol": "http", "url": "127.0.0.1:1", "model": "m", "input_data": tmp_path / "in.json"}
    return pa.PerfAnalyzerRun(**{**args, "concurrency": 8, "window_requests": 16, **kw})


def test_run_reads_the_report_it_was_told_to_write(tmp_path: Path) -> None:
    body = f"cat > \"$csv\" <<'X'\n{CSV}\nX\ncat <<'X'\n{OUTPUT}X\n"
    result = pa.run(_spec(tmp_path), _fake(tmp_path, body))
    assert result.requests == 300 and result.throughput > 0


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("echo 'error: failed to get model metadata'; exit 99\n", "exited with 99"),
        (f"cat > \"$csv\" <<'X'\n{CSV}\nX\necho 'Thread [0] had error: reset'\n", "reported"),
        ("echo 'Request count: 3'\n", "no CSV"),
        ("sleep 5\n", "ran past"),
    ],
)
def test_run_failures_are_typed_errors_with_the_output(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(pa.PerfAnalyzerError, match=match) as caught:
        pa.run(_spec(tmp_path, timeout_s=1.0), _fake(tmp_path, body))
    if "exit 99" in body:
        assert "model metadata" in caught.value.output


def test_a_cell_is_sized_by_payload_and_reads_mb_s_latency_and_cpu(tmp_path: Path, monkeypatch) -> None:
    from ray_triton_shm._private.bench.frontdoor_perf import PerfAnalyzerCells

    body = f"cat > \"$csv\" <<'X'\n{CSV}\nX\ncat <<'X'\n{OUTPUT}X\n"
    monkeypatch.setenv(pa.ENV_BINARY, str(_fake(tmp_path, body)))
    cells = PerfAnalyzerCells(tmp_path, bytes_per_window=64 * 2**20, min_requests=16)
    assert cells.window_requests(2**20, 8) == 64
    assert cells.window_requests(16 * 2**20, 1) == 16  # the minimum
    assert cells.window_requests(16 * 2**20, 12) == 24  # two per caller
    cell = cells.run("grpc", ["127.0.0.1:1"], "identity", 2**20, 8)
    assert cell.error is None and cell.calls == 300
    assert cell.mb_s == pytest.approx(299.846 * 2**20 / 1e6)
    assert cell.p50_ms == pytest.approx(21.43)
    assert cell.cpu_s >= 0
    assert json.loads((tmp_path / f"input-{2**20}.json").read_text())["data"][0]["INPUT0"]["shape"] == [2**18]


def test_a_failed_cell_carries_perf_analyzers_error(tmp_path: Path, monkeypatch) -> None:
    from ray_triton_shm._private.bench.frontdoor_perf import PerfAnalyzerCells

    body = "echo 'error: failed to get model metadata: unknown model'; exit 99\n"
    monkeypatch.setenv(pa.ENV_BINARY, str(_fake(tmp_path, body)))
    cell = PerfAnalyzerCells(tmp_path, 2**20, 8).run("http", ["127.0.0.1:1"], "nope", 4096, 1)
    assert cell.calls == 0 and "exited with 99" in cell.error and "unknown model" in cell.error
