"""The node actor's user registry: a user counts while its process lives, wherever its pid namespace is."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ray_triton_shm._private.node_registry import UserLock, Users
from ray_triton_shm._private.segment import list_segments

# A user process: takes its proof of life, says its pid (as it sees it) and the proof's name,
# then lives until its stdin closes.
_USER = (
    "import os, sys\n"
    "from ray_triton_shm._private.node_registry import UserLock\n"
    "lock = UserLock()\n"
    "print(os.getpid(), lock.name, flush=True)\n"
    "sys.stdin.read()\n"
)


def _wait_reaped(users: Users, user_id: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(u.user_id == user_id for u in users.reap()):
            return True
        time.sleep(0.05)
    return False


def _user_process(prefix: list[str]) -> tuple[subprocess.Popen[str], int, str]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _USER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pid, name = proc.stdout.readline().split()
    return proc, int(pid), name


def test_an_attach_from_a_process_that_already_died_is_reaped() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # gone (and reaped) before its attach arrives
    users = Users()
    users.attach("late", dead.pid, "client")
    assert [u.user_id for u in users.reap()] == ["late"], "a user whose process is gone was kept"
    assert len(users) == 0 and users.idle_for() >= 0


def test_a_user_counts_while_its_lock_is_held_and_goes_with_it() -> None:
    proc, pid, name = _user_process([])
    users = Users()
    try:
        users.attach("u", pid, "client", lock=name)
        assert users.reap() == [] and len(users) == 1
        proc.kill()  # SIGKILL: no detach, the lock's file stays behind
        proc.wait()
        assert _wait_reaped(users, "u"), "a user whose lock holder died was kept"
        assert name not in list_segments(), "the dead user's lock file was left in /dev/shm"
    finally:
        proc.kill()
        proc.wait()


def test_a_user_lock_refuses_the_pid_of_a_forked_child() -> None:
    lock = UserLock()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: it holds no copy of its parent's lock
            os._exit(0)
        os.waitpid(pid, 0)
        users = Users()
        users.attach("parent", os.getpid(), "client", lock=lock.name)
        assert users.reap() == [], "the parent's lock was let go by its forked child"
    finally:
        lock.close()
    assert lock.name not in list_segments()


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to make a second pid namespace")
def test_a_user_in_another_pid_namespace_counts_while_alive_and_goes_when_it_exits() -> None:
    # A user whose pid means another process here, or none: only its lock tells.
    proc, pid, name = _user_process(["unshare", "--pid", "--fork", "--mount-proc"])
    users = Users()
    try:
        assert pid < 10, f"not in a fresh pid namespace (pid {pid})"
        users.attach("far", pid, "serve", lock=name)
        time.sleep(0.2)
        assert users.reap() == [], "a live user in another pid namespace was reaped"
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
        assert _wait_reaped(users, "far"), "a user in another pid namespace was kept after it exited"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    for leftover in list_segments(name):
        os.unlink(f"/dev/shm/{leftover}")
