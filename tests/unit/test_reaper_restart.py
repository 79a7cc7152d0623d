"""A node actor's reaper that dies is started again and knows what the first knew."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ray_triton_shm._private.node.reaper import Reaper
from tests.helpers import wait_for


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_a_dead_reaper_is_restarted_and_still_kills_the_triton_it_was_told_about() -> None:
    marker = f"rtshm_0_0_pyb_restarttest{os.getpid()}_"
    triton = subprocess.Popen(  # plays Triton: leads its own group, carries its marker
        [sys.executable, "-c", "import time; time.sleep(120)", marker], start_new_session=True
    )
    reaper = Reaper()
    try:
        reaper.watch_triton(triton.pid, marker)
        first = reaper.pid
        os.kill(first, signal.SIGKILL)  # as the OOM killer would
        assert wait_for(lambda: not _alive(first))
        assert reaper.state()["alive"] is False
        assert reaper.check(), "a dead reaper was not started again"
        state = reaper.state()
        assert state["alive"] is True and state["restarts"] == 1 and reaper.pid != first, state
        assert f"pid {first}" in str(state["last_failure"]), state
        assert not reaper.check()  # alive: nothing to do
        # The owner lets go with its Triton still running: the new reaper kills the Triton it
        # was told about ("done": it need not wait for this process, which lives on, to exit).
        reaper._stdin.write(b"done\n")
        reaper._stdin.close()
        assert wait_for(lambda: triton.poll() is not None), "the restarted reaper did not kill the Triton"
    finally:
        if triton.poll() is None:
            triton.kill()
        triton.wait()
        reaper.close()
