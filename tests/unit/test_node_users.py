"""The node actor's user registry: a user counts while its process lives, wherever its pid namespace is."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ray_triton_shm._private.node.node_registry import UserLock, Users
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.sweep import list_segments
from ray_triton_shm.errors import UnavailableError

# A user process: locks its byte of the users file, says its pid (as it sees it) and its
# byte's offset, then lives until its stdin closes.
_USER = (
    "import os, sys\n"
    "from ray_triton_shm._private.node.node_registry import UserLock\n"
    "lock = UserLock()\n"
    "lock.hold(sys.argv[1])\n"
    "print(os.getpid(), lock.offset, flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def users_file():
    owned = Segment.create(new_segment_name("userstest"), 1)
    yield owned.name
    owned.close()


def _wait_reaped(users: Users, user_id: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(u.user_id == user_id for u in users.reap()):
            return True
        time.sleep(0.05)
    return False


def _user_process(prefix: list[str], users_file: str) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _USER, users_file],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pid, offset = proc.stdout.readline().split()
    return proc, int(pid), int(offset)


def test_an_attach_from_a_process_that_already_died_is_reaped() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # gone (and reaped) before its attach arrives
    users = Users()
    users.attach("late", dead.pid, "client")
    assert [u.user_id for u in users.reap()] == ["late"], "a user whose process is gone was kept"
    assert len(users) == 0


def test_a_user_counts_while_its_lock_is_held_and_leaves_nothing_behind(users_file: str) -> None:
    proc, pid, offset = _user_process([], users_file)
    users = Users(users_file)
    try:
        users.attach("u", pid, "client", lock=offset)
        assert users.reap() == [] and len(users) == 1
        proc.kill()  # SIGKILL: no detach
        proc.wait()
        assert _wait_reaped(users, "u"), "a user whose process died was kept"
        assert list_segments(f"rtshm_{pid}_") == [], "a dead user left a file in /dev/shm"
    finally:
        proc.kill()
        proc.wait()
        users.close()


def test_an_attach_whose_lock_is_not_held_is_refused(users_file: str) -> None:
    users = Users(users_file)
    try:
        with pytest.raises(UnavailableError, match="holds no lock"):
            users.attach("u", os.getpid(), "client", lock=UserLock().offset)
        assert len(users) == 0
    finally:
        users.close()


def test_a_forked_child_does_not_keep_its_parents_user_lock(users_file: str) -> None:
    lock = UserLock()
    lock.hold(users_file)
    users = Users(users_file)
    try:
        users.attach("parent", os.getpid(), "client", lock=lock.offset)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: lets go of its copy, as a worker's cleanup would
            lock.close()
            os._exit(0)
        os.waitpid(pid, 0)
        assert users.reap() == [], "the parent's lock was let go by its forked child"
        lock.close()
        assert _wait_reaped(users, "parent")
    finally:
        lock.close()
        users.close()


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to make a second pid namespace")
def test_a_user_in_another_pid_namespace_counts_while_alive_and_goes_when_it_exits(users_file: str) -> None:
    # A user whose pid means another process here, or none: only its lock tells.
    proc, pid, offset = _user_process(["unshare", "--pid", "--fork", "--mount-proc"], users_file)
    users = Users(users_file)
    try:
        assert pid < 10, f"not in a fresh pid namespace (pid {pid})"
        users.attach("far", pid, "serve", lock=offset)
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
        users.close()


def test_idle_time_counts_from_the_start_of_the_clock_and_stops_while_a_user_is_there() -> None:
    users = Users()
    time.sleep(0.2)
    assert users.idle_for() >= 0.2  # from the registry's creation
    users.start_idle_clock()  # the actor is ready only now (Triton took its time to start)
    assert users.idle_for() < 0.2
    users.attach("u", os.getpid(), "client")
    users.start_idle_clock()  # a user is there: no idle time to count
    assert users.idle_for() == 0.0 and "u" in users
    users.detach("u")
    assert "u" not in users and users.idle_for() < 0.2
