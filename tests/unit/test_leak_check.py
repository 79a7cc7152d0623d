"""The suite's own leak check (tests/conftest.py), on real /dev/shm entries and a real process.

The per-module check spares what the session's shared Triton keeps across
modules: its Python-backend files and the locked segment guarding them. A
module run alone that is the first to use that server would otherwise be
charged with the guard (seen on tests/integration/test_hard_paths.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from ray_triton_shm._private.shm import segment

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture(scope="module")
def leak_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rtshm_root_conftest_under_test", ROOT_CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_module_check_spares_a_session_servers_guard_and_backend_files(leak_check: ModuleType) -> None:
    segments_before, triton_before = leak_check._segments(), leak_check._triton_pids()
    # What a TritonServer makes: the guard, and the Python backend's files named guard + "_" + ...
    guard = segment.Segment.create(segment.new_segment_name("pyb"), 1)
    backend_file = segment.Segment.create(f"{guard.name}_0f1e2d3c-region", 1)
    stray = segment.Segment.create(segment.new_segment_name("pool"), 1)
    # A stand-in for the session's server: only its command line is read.
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.read()",
            f"--backend-config=python,shm-region-prefix-name={guard.name}_",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        # Popen returns once exec has begun; the new command line shows a moment later.
        deadline = time.monotonic() + 10
        while b"shm-region-prefix-name" not in (leak_check._read(f"/proc/{server.pid}/cmdline") or b""):
            assert time.monotonic() < deadline, "the stand-in server's command line never showed"
            time.sleep(0.01)
        left, _ = leak_check._wait_for_leftovers(segments_before, triton_before, "", 0.0, {server.pid})
        assert left == [stray.name], left
        # Not spared (the session check, or a server that is not the session's): all three are leaks.
        left, _ = leak_check._wait_for_leftovers(segments_before, triton_before, "", 0.0, set())
        assert sorted(left) == sorted([guard.name, backend_file.name, stray.name]), left
    finally:
        server.communicate(b"")
        for made in (stray, backend_file, guard):
            made.close()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rtshm_1_2_pyb_ab", True),  # the guard
        ("rtshm_1_2_pyb_ab_d90c36e5", True),  # a backend file
        ("rtshm_1_2_pyb_abc", False),  # another guard whose name merely starts alike
        ("rtshm_1_2_pool_ab", False),
    ],
)
def test_backend_segment_names(leak_check: ModuleType, name: str, expected: bool) -> None:
    assert leak_check._backend_segment(name, ("rtshm_1_2_pyb_ab_",)) is expected
    assert leak_check._backend_segment(name, ()) is False
