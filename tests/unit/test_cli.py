from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from ray_triton_shm._private.cli import cli
from ray_triton_shm._private.shm import segment, sweep


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_stale() -> str:
    """A /dev/shm file named as if owned by a process that has exited."""
    name = f"{segment.owner_tag(_dead_pid())}_pool_{os.urandom(16).hex()}"
    with open(os.path.join(segment.SHM_DIR, name), "wb") as f:
        f.truncate(4096)
    return name


@pytest.fixture
def stale_segment() -> Iterator[Callable[[], str]]:
    """Plants stale segments (a new one per call); removes whatever is left of them afterwards."""
    planted: list[str] = []

    def plant() -> str:
        planted.append(_plant_stale())
        return planted[-1]

    yield plant
    for name in planted:
        segment.unlink_segment(name)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TRITON_SHM_")}
    return subprocess.run(
        [sys.executable, "-m", "ray_triton_shm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


# A stale segment is stale for everyone: a Triton started by another run on this machine sweeps
# it too, and may do so between planting and the CLI's listing. Such a try tells nothing (the
# segment is gone and the CLI did not name it); a CLI that is wrong is wrong on every try.
_TRIES = 5


def _cli_on_a_planted_segment(
    plant: Callable[[], str], verb: str, *args: str
) -> tuple[str, subprocess.CompletedProcess]:
    for _ in range(_TRIES):
        name = plant()
        out = _run_cli("cleanup", *args)
        assert out.returncode == 0, out.stderr
        named = f"{verb} {name}" in out.stdout.splitlines()
        if named or os.path.exists(os.path.join(segment.SHM_DIR, name)):
            return name, out
    pytest.fail(f"every planted segment vanished unnamed by the CLI in {_TRIES} tries")


def test_cleanup_dry_run_lists_without_removing(stale_segment: Callable[[], str]) -> None:
    live = segment.Segment.create(segment.new_segment_name("test"), 4096)
    try:
        stale, out = _cli_on_a_planted_segment(stale_segment, "would remove")
        assert f"would remove {stale}" in out.stdout.splitlines()
        assert "--yes" in out.stdout
        assert live.name not in out.stdout
        assert os.path.exists(os.path.join(segment.SHM_DIR, stale))
    finally:
        live.close()


def test_cleanup_yes_removes(stale_segment: Callable[[], str]) -> None:
    live = segment.Segment.create(segment.new_segment_name("test"), 4096)
    try:
        stale, out = _cli_on_a_planted_segment(stale_segment, "removing", "--yes")
        assert f"removing {stale}" in out.stdout.splitlines()
        assert not os.path.exists(os.path.join(segment.SHM_DIR, stale))
        assert os.path.exists(os.path.join(segment.SHM_DIR, live.name)), "a live owner's segment was removed"
    finally:
        live.close()


def test_cleanup_with_nothing_stale(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sweep, "stale_segments", lambda: [])
    monkeypatch.setattr(sweep, "sweep_stale_segments", lambda: pytest.fail("nothing to sweep"))
    assert cli.main(["cleanup", "--yes"]) == 0
    assert "no stale segments" in capsys.readouterr().out


def test_cli_requires_a_command(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "command" in capsys.readouterr().err


def test_cleanup_leaves_segments_locked_by_an_owner_in_another_pid_namespace(
    stale_segment: Callable[[], str],
) -> None:
    """An owner elsewhere (its pid names nothing here) holds its segment's lock: not stale, not removed."""
    name = f"{segment.owner_tag(_dead_pid())}_pool_{os.urandom(16).hex()}"
    path = os.path.join(segment.SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale, listed = _cli_on_a_planted_segment(stale_segment, "would remove")
        assert f"would remove {stale}" in listed.stdout.splitlines()
        assert name not in listed.stdout
        stale, removed = _cli_on_a_planted_segment(stale_segment, "removing", "--yes")
        assert f"removing {stale}" in removed.stdout.splitlines()
        assert name not in removed.stdout
        assert os.path.exists(path) and not os.path.exists(os.path.join(segment.SHM_DIR, stale))
    finally:
        os.close(fd)
        segment.unlink_segment(name)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["soak"], {"duration": 120.0, "callers": 16, "slots": 4, "target": "all"}),
        (
            ["soak", "--duration", "20", "--callers", "8", "--slots", "2", "--target", "client"],
            {"duration": 20.0, "callers": 8, "slots": 2, "target": "client"},
        ),
        (["bench-sharing"], {"size": 4096, "rounds": 6, "calls": 400, "model_repository": None}),
        (
            ["bench-sharing", "--size", "1024", "--rounds", "8", "--calls", "10", "--model-repository", "m"],
            {"size": 1024, "rounds": 8, "calls": 10, "model_repository": "m"},
        ),
        (["bench-docs"], {"results_dir": "bench-results", "docs_file": "docs/benchmarks.md"}),
        (["bench-docs", "r", "d.md"], {"results_dir": "r", "docs_file": "d.md"}),
        (
            ["bench-cuda", "--mb", "8", "--repeats", "2", "--url", "h:1", "--json", "o.json"],
            {"mb": (8,), "repeats": 2, "url": "h:1", "json": "o.json", "gpu_model": False},
        ),
        (
            ["bench-cuda", "--gpu-model", "--mb", "64,256"],
            {"mb": (64, 256), "gpu_model": True, "model_repository": None},
        ),
    ],
)
def test_tool_commands_take_their_flags(argv: list[str], expected: dict[str, object]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected


@pytest.mark.parametrize("command", ["soak", "bench-sharing", "bench-docs", "bench-cuda"])
def test_tool_commands_have_help(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: ray-triton-shm {command}" in capsys.readouterr().out


def test_bench_docs_pastes_the_report_between_the_markers(tmp_path) -> None:
    results = tmp_path / "bench-results"
    results.mkdir()
    (results / "report.md").write_text("## Results\n\n![plot](latency.png)\n")
    (results / "latency.png").write_bytes(b"png")
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n<!-- bench:begin -->\nold\n<!-- bench:end -->\ntail\n")
    assert cli.main(["bench-docs", str(results), str(docs)]) == 0
    assert docs.read_text() == (
        "# Benchmarks\n<!-- bench:begin -->\n### Results\n\n![plot](img/bench-latency.png)\n\n"
        "<!-- bench:end -->\ntail\n"
    )
    assert (tmp_path / "docs" / "img" / "bench-latency.png").read_bytes() == b"png"


def test_bench_docs_pastes_the_front_door_table_between_its_markers(tmp_path) -> None:
    results = tmp_path / "bench-results"
    results.mkdir()
    (results / "report.md").write_text("## Results\n")
    (results / "frontdoor.md").write_text("## Front door\n\n| a |\n")
    docs = tmp_path / "benchmarks.md"
    docs.write_text(
        "<!-- frontdoor:begin -->\nold\n<!-- frontdoor:end -->\nmid\n"
        "<!-- bench:begin -->\n<!-- bench:end -->\n"
    )
    assert cli.main(["bench-docs", str(results), str(docs)]) == 0
    assert docs.read_text() == (
        "<!-- frontdoor:begin -->\n### Front door\n\n| a |\n\n<!-- frontdoor:end -->\nmid\n"
        "<!-- bench:begin -->\n### Results\n\n<!-- bench:end -->\n"
    )
    docs.write_text("<!-- bench:begin -->\n<!-- bench:end -->\n")
    with pytest.raises(ValueError, match="frontdoor:begin"):
        cli.main(["bench-docs", str(results), str(docs)])


def test_bench_cuda_needs_neither_ray_nor_the_http_client() -> None:
    # A GPU machine may carry only tritonclient's gRPC half (no gevent) and no Ray: the command
    # line and the CUDA benchmark must load without them.
    blocked = "tritonclient.http", "gevent", "ray"
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from ray_triton_shm._private.cli import cli\n"
        "from ray_triton_shm._private.bench import cuda_paths\n"
        "cli.build_parser().parse_args(['bench-cuda', '--mb', '1'])\n"
        "print('loaded')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"
