"""bench-cuda's table: ratios per size, the CUDA shm target, the d2d row, and its answer without a GPU."""

from __future__ import annotations

import argparse
import io
from typing import Any

import pytest

from ray_triton_shm._private.bench import cuda_paths
from ray_triton_shm._private.bench.measure import Timing
from ray_triton_shm._private.cli import cli


def _row(path: str, mb: int, gb_per_s: float, matched: bool = True) -> dict[str, Any]:
    return {
        "path": path,
        "mb": mb,
        "median_ms": 1.0,
        "p90_ms": 1.0,
        "gb_per_s": gb_per_s,
        "repeats": 3,
        "matched": matched,
    }


ROWS = [
    _row("grpc", 256, 0.2),
    _row("d2d", 64, 1500.0),
    _row("shm", 64, 2.0),
    _row("cuda_shm", 256, 40.0),
    _row("grpc", 64, 0.25),
    _row("cuda_shm", 64, 12.0),
    _row("shm", 256, 2.5),
]


def test_rows_are_ordered_by_size_and_path_with_ratios_of_their_own_size() -> None:
    table = cuda_paths.with_ratios(ROWS)
    assert [(r["mb"], r["path"]) for r in table] == [
        (64, "cuda_shm"),
        (64, "shm"),
        (64, "grpc"),
        (64, "d2d"),
        (256, "cuda_shm"),
        (256, "shm"),
        (256, "grpc"),
    ]
    by = {(r["mb"], r["path"]): r for r in table}
    assert by[64, "cuda_shm"]["x_shm"] == 6.0 and by[64, "cuda_shm"]["x_grpc"] == 48.0
    assert by[256, "cuda_shm"]["x_shm"] == 16.0 and by[256, "cuda_shm"]["x_grpc"] == 200.0
    assert by[64, "d2d"]["x_shm"] == 750.0
    assert by[64, "shm"]["x_shm"] == 1.0
    assert ROWS[0].get("x_shm") is None, "the caller's rows are left as they were"


def test_a_size_without_a_reference_row_has_no_ratio() -> None:
    table = cuda_paths.with_ratios([_row("cuda_shm", 16, 5.0), _row("shm", 16, 0.0)])
    assert [r["x_grpc"] for r in table] == [None, None]
    assert [r["x_shm"] for r in table] == [None, None]


def test_target_verdict() -> None:
    assert cuda_paths.target_verdict(ROWS) == "target: CUDA shm >= 5x system shm at 64 MB: 6.00x, met"
    slow = [_row("cuda_shm", 64, 9.0), _row("shm", 64, 2.0)]
    assert cuda_paths.target_verdict(slow) == "target: CUDA shm >= 5x system shm at 64 MB: 4.50x, NOT met"
    wrong = [_row("cuda_shm", 64, 12.0, matched=False), _row("shm", 64, 2.0)]
    assert cuda_paths.target_verdict(wrong).endswith("6.00x, NOT met"), "a wrong answer meets no target"
    assert cuda_paths.target_verdict([_row("cuda_shm", 256, 9.0), _row("shm", 256, 1.0)]) is None
    assert cuda_paths.target_verdict(slow, factor=4.0).endswith("4.50x, met")


def test_printed_table() -> None:
    out = io.StringIO()
    cuda_paths.print_table(ROWS, out, target=True)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "path",
        "MB",
        "median",
        "ms",
        "p90",
        "ms",
        "GB/s",
        "x",
        "grpc",
        "x",
        "shm",
        "ok",
    ]
    assert lines[1].split() == ["cuda_shm", "64", "1.0", "1.0", "12.0", "48.0", "6.00", "yes"]
    assert lines[4].split()[:2] == ["d2d", "64"]
    assert any(line.startswith("d2d = one cupy device-to-device copy") for line in lines)
    assert lines[-1] == "target: CUDA shm >= 5x system shm at 64 MB: 6.00x, met"
    plain = io.StringIO()
    cuda_paths.print_table([r for r in ROWS if r["path"] != "d2d"], plain)
    assert "target" not in plain.getvalue() and "d2d" not in plain.getvalue()


def test_rows_from_timings() -> None:
    row = cuda_paths._row("shm", 64, Timing((0.5, 0.1, 0.2), 2 * 64 * cuda_paths.MB), True)
    assert row["median_ms"] == 200.0 and row["repeats"] == 3
    assert row["gb_per_s"] == round(2 * 64 * cuda_paths.MB / 0.2 / 1e9, 3)


@pytest.mark.parametrize("text, sizes", [("64", (64,)), ("64,256", (64, 256)), (" 8 , 16 ", (8, 16))])
def test_sizes_flag(text: str, sizes: tuple[int, ...]) -> None:
    assert cli._sizes_mb(text) == sizes


@pytest.mark.parametrize("text", ["", "0", "64,-1", "a,b", "1.5"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli._sizes_mb(text)


def _usable_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize("gpu_model", [True, False])
def test_without_a_gpu_it_says_so_and_measures_nothing(
    gpu_model: bool, capsys: pytest.CaptureFixture
) -> None:
    if _usable_gpu():
        pytest.skip("this machine has a GPU: bench-cuda would run")
    argv = ["bench-cuda", "--mb", "64,256"] + (["--gpu-model"] if gpu_model else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "bench-cuda: no GPU device here" in err
    needs = "the GPU-model rows need a CUDA device" if gpu_model else "bench-cuda needs a GPU"
    assert needs in err
