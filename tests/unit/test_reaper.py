"""The node actor's reaper process, run on its own (no Ray, no Triton): what it kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ray_triton_shm._private.node.reaper import _REAPER
from tests.helpers import pid_alive

_MARKER = f"rtshm_0_0_pyb_reapertest{os.getpid()}_"  # a server's backend region prefix

# Plays Triton: leads its own process group, starts a "stub" in it, prints the stub's pid and
# exits without being waited for, so it stays a zombie (an empty command line) for a while,
# as a Triton killed with its actor does until init reaps it.
# Its stub carries the server's marker (the Python backend's region prefix) on its command line.
_FAKE_TRITON = (
    "import subprocess, sys\n"
    "stub = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1]])\n"
    "print(stub.pid, flush=True)\n"
)


def test_reaper_kills_the_group_of_a_triton_that_died_unreaped() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", _FAKE_TRITON, _MARKER], stdout=subprocess.PIPE, start_new_session=True
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
        reaper.stdin.write(f"triton {leader.pid}\nmarker {_MARKER}\n".encode())
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


def _run_reaper(prefix: str, *lines: str) -> None:
    """Start the reaper for ``prefix``, tell it ``lines``, let it run (its owner is gone) and wait for it."""
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert reaper.stdin is not None and reaper.stdout is not None
    try:
        reaper_pid = int(reaper.stdout.readline())
        reaper.wait(30)
        for line in lines:
            reaper.stdin.write(f"{line}\n".encode())
        reaper.stdin.close()
        deadline = time.monotonic() + 30
        while pid_alive(reaper_pid):
            assert time.monotonic() < deadline, "the reaper did not finish"
            time.sleep(0.05)
    finally:
        reaper.stdout.close()


# Holds the flock of a segment it creates (as a live owner in another container sharing
# /dev/shm would) until its stdin closes.
_HOLDER = (
    "import sys\n"
    "from ray_triton_shm._private.shm.segment import Segment\n"
    "s = Segment.create(sys.argv[1], 64)\n"
    "print('ok', flush=True)\n"
    "sys.stdin.read()\n"
    "s.close()\n"
)


def test_reaper_leaves_segments_whose_owner_lives_elsewhere() -> None:
    # Two containers sharing /dev/shm can have owners with equal pids and start times:
    # the reaper's name prefix then also matches the other owner's segments.
    prefix = f"rtshm_7_7_reapertest{os.getpid()}_"
    live, dead = f"{prefix}pyb_live", f"{prefix}slots_dead"
    guarded = f"{live}_region"  # a Python-backend file: never locked, guarded by the live segment
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, live], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "ok"
        for name in (dead, guarded):  # dead: ours, its owner (and its lock) gone
            with open(f"/dev/shm/{name}", "wb") as f:
                f.write(b"x")
        _run_reaper(prefix)
        assert not os.path.exists(f"/dev/shm/{dead}"), "the reaper left its dead owner's segment"
        assert os.path.exists(f"/dev/shm/{live}"), "the reaper removed a segment another live owner holds"
        assert os.path.exists(f"/dev/shm/{guarded}"), "the reaper removed a file another live owner guards"
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
        for name in (live, dead, guarded):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_reaper_spares_a_group_that_is_not_its_tritons() -> None:
    # The Triton the reaper was told about is long gone and its pid now leads an unrelated
    # group (as after pid reuse): the group's leader exited and was reaped, a member lives on.
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "m = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(m.pid, flush=True)\n",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    leader.wait(30)  # reaped: /proc/<leader> is gone, its group lives on in the member
    leader.stdout.close()
    try:
        assert not os.path.exists(f"/proc/{leader.pid}")
        marker = f"rtshm_0_0_pyb_reapertest{os.getpid()}_"  # what its Triton's processes would carry
        _run_reaper(f"rtshm_0_0_reapertest{os.getpid()}_", f"triton {leader.pid}", f"marker {marker}")
        time.sleep(0.2)
        assert pid_alive(member), "the reaper killed a process group that was not its Triton's"
    finally:
        if pid_alive(member):
            os.kill(member, signal.SIGKILL)


# An owner whose end of the reaper's pipe closes while it still holds its segments' locks, as
# in a process exit (the kernel closes its files one by one; the pipe may go first): it holds
# the segment a second longer, then dies.
_DYING_OWNER = (
    "import os, sys, time\n"
    "from ray_triton_shm._private.node.reaper import Reaper\n"
    "from ray_triton_shm._private.shm.segment import Segment, new_segment_name\n"
    "reaper = Reaper()\n"
    "kept = Segment.create(new_segment_name('slots'), 64)\n"
    "print(reaper.pid, kept.name, flush=True)\n"
    "reaper._stdin.close()\n"
    "time.sleep(1.0)\n"
    "os._exit(0)\n"
)


def _assert_reaped(owner_script: str) -> None:
    """Run ``owner_script`` (it prints its reaper's pid and a segment it owns, then dies); the
    segment must be gone once the reaper has finished."""
    owner = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    reaper_pid, name = owner.stdout.readline().split()
    try:
        owner.wait(30)
        deadline = time.monotonic() + 30
        while pid_alive(int(reaper_pid)):
            assert time.monotonic() < deadline, "the reaper did not finish"
            time.sleep(0.05)
        assert not os.path.exists(f"/dev/shm/{name}"), "the reaper left a segment of its dead owner"
    finally:
        owner.stdout.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_reaper_removes_segments_whose_dying_owner_held_them_when_the_pipe_closed() -> None:
    _assert_reaped(_DYING_OWNER)


# A threaded owner whose first thread has exited (a zombie in /proc) while another thread
# still runs and holds the process's files, as in a multi-threaded process's exit (a Ray
# worker's): the segment stays locked until that thread is gone too.
_THREADED_OWNER = (
    "import ctypes, os, threading, time\n"
    "from ray_triton_shm._private.node.reaper import Reaper\n"
    "from ray_triton_shm._private.shm.segment import Segment, new_segment_name\n"
    "reaper = Reaper()\n"
    "kept = Segment.create(new_segment_name('slots'), 64)\n"
    "print(reaper.pid, kept.name, flush=True)\n"
    "def last():\n"
    "    time.sleep(1.5)\n"
    "    os._exit(0)\n"
    "threading.Thread(target=last).start()\n"
    "reaper._stdin.close()\n"
    "ctypes.CDLL(None).pthread_exit(None)\n"
)


def test_reaper_waits_for_every_thread_of_its_dying_owner() -> None:
    _assert_reaped(_THREADED_OWNER)


def test_reaper_removes_its_dead_owners_python_backend_directory_and_nothing_else(tmp_path) -> None:
    """The Triton's Python-backend directory goes after an owner that died, not after one that let go;
    a path that is not such a directory in /tmp is never removed."""
    import tempfile

    prefix = f"rtshm_0_0_reapertest{os.getpid()}_"  # names no segment
    made = [tempfile.mkdtemp(prefix="python_env_", dir="/tmp") for _ in range(2)]
    try:
        for path in made:
            with open(os.path.join(path, "extracted"), "w") as f:
                f.write("x")
        _run_reaper(prefix, f"pyenv {made[0]}", "done")  # let go: its Triton stopped itself
        assert os.path.isdir(made[0])
        _run_reaper(prefix, f"pyenv {made[0]}")  # died
        assert not os.path.exists(made[0]), "the dead owner's Triton directory is left"
        elsewhere = tmp_path / "python_env_elsewhere"
        elsewhere.mkdir()
        link = f"/tmp/python_env_link{os.getpid()}"
        os.symlink(made[1], link)
        try:
            for path in (str(elsewhere), link, "/tmp", f"/tmp/other{os.getpid()}"):
                _run_reaper(prefix, f"pyenv {path}")
            assert elsewhere.is_dir() and os.path.isdir(made[1])
        finally:
            os.unlink(link)
    finally:
        for path in made:
            if os.path.exists(path):
                for name in os.listdir(path):
                    os.unlink(os.path.join(path, name))
                os.rmdir(path)
