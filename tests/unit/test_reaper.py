"""The node actor's reaper process, run on its own (no Ray, no Triton): what it kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ray_triton_shm._private.node.node_registry import _REAPER
from tests.helpers import pid_alive

# Plays Triton: leads its own process group, starts a "stub" in it, prints the stub's pid and
# exits without being waited for, so it stays a zombie (an empty command line) for a while,
# as a Triton killed with its actor does until init reaps it.
_FAKE_TRITON = (
    "import subprocess, sys\n"
    "stub = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(stub.pid, flush=True)\n"
)


def test_reaper_kills_the_group_of_a_triton_that_died_unreaped() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", _FAKE_TRITON, "tritonserver"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    stub = int(leader.stdout.readline())
    reaper = None
    try:
        deadline = time.monotonic() + 30
        while pid_alive(leader.pid):
            assert time.monotonic() < deadline, "the fake Triton did not exit"
            time.sleep(0.05)
        with open(f"/proc/{leader.pid}/cmdline", "rb") as f:
            assert f.read() == b"", "the fake Triton should be a zombie, unreaped"
        assert pid_alive(stub)
        prefix = f"rtshm_0_0_reapertest{os.getpid()}_"  # names no segment
        reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert reaper.stdin is not None and reaper.stdout is not None
        reaper_pid = int(reaper.stdout.readline())
        reaper.wait(30)  # the launcher exits at once; the reaper itself forked away
        reaper.stdin.write(f"triton {leader.pid}\n".encode())
        reaper.stdin.close()  # its owner is gone
        deadline = time.monotonic() + 30
        while pid_alive(stub) or pid_alive(reaper_pid):
            assert time.monotonic() < deadline, "the stub outlived its dead Triton's reaper"
            time.sleep(0.05)
    finally:
        if pid_alive(stub):
            os.kill(stub, signal.SIGKILL)
        leader.wait(30)
        leader.stdout.close()
        if reaper is not None and reaper.stdout is not None:
            reaper.stdout.close()
