"""The node actor's reaper: what goes when the actor does, however it dies.

:class:`Reaper` starts a small process tied to the actor's life by a pipe:
when the actor dies in any way (``ray.kill``, SIGKILL, ``ray stop``, a lost
node), the pipe's other end closes and the reaper kills the actor's Triton and
removes every segment the actor owned. The reaper's program (``_REAPER``) runs
in a fresh interpreter and imports nothing of this package.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

from ray_triton_shm._private.shm.segment import SEGMENT_PREFIX, owner_tag, process_start_time

logger = logging.getLogger(__name__)


# The reaper: forks once more and lets its parent exit, so it is nobody's child: Ray kills the
# children of a worker it kills (``ray.kill``), and the reaper must outlive the actor. It reports
# its pid on stdout, then reads what to clean up from stdin ("triton <pid>": the process group
# of the owner's Triton; "marker <text>": what that Triton's command line and its backend stubs'
# carry; "pyenv <path>": that Triton's Python-backend directory; "done": the owner lets go in
# order) until EOF (its owner died or let go). Then it SIGKILLs that group if it is still
# Triton's, unlinks the owner's segments whose lock no live owner holds and, after an owner
# that died, removes that directory. Unless the owner let go, it first waits (10 s at most) for
# every thread of the owner to be gone, and looks again for 2 s at segments still locked: a
# dying process closes its files one by one (the pipe may close first), and its first thread
# can be a zombie while another still holds its files.
# -I -S: no site, no user paths; it must start fast and import nothing of ours.
_REAPER = r"""
import fcntl, os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdout.write("%d\n" % os.getpid())
sys.stdout.flush()
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
prefix, triton, marker, done, pyenv = sys.argv[1], 0, b"", False, ""
for line in sys.stdin:
    word, _, value = line.strip().partition(" ")
    if word == "triton":
        triton = int(value)
    elif word == "marker":
        marker = value.encode()
    elif word == "pyenv":
        pyenv = value
    elif word == "done":
        done = True


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""  # unreadable: proves nothing


def tritons(pgid):
    # Triton may be dead already (Ray kills a killed worker's children; it may be a zombie with an
    # empty command line, or reaped) while its backend stubs live on in its group, and its pid may
    # since lead another group. The group is Triton's only if one of its processes carries the
    # marker (the Python backend's region prefix: 128 random bits) on its command line.
    if not marker:
        return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2 :].split()[2]) == pgid and marker in cmdline(int(entry)):
            return True
    return False


if triton > 0 and tritons(triton):
    try:
        os.killpg(triton, signal.SIGKILL)
    except OSError:
        pass


def locked(name):
    # Whether a live owner holds the segment's lock: ours are all free once the owner died, so a
    # held one belongs to another owner whose name starts alike (another container sharing
    # /dev/shm can have an owner of the same pid and start time).
    try:
        fd = os.open("/dev/shm/" + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def unlink_unowned(name):
    path = "/dev/shm/" + name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def owner_running():
    # The owner is named by the prefix: rtshm_<pid>_<start time>_. Its files close when its last
    # thread exits: its first thread may be a zombie already while others still run.
    _, pid, start = prefix.split("_")[:3]
    try:
        with open("/proc/%s/stat" % pid, "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[19] != start.encode():
                return False
        threads = os.listdir("/proc/%s/task" % pid)
    except (OSError, ValueError, IndexError):
        return False
    for thread in threads:
        try:
            with open("/proc/%s/task/%s/stat" % (pid, thread), "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                    return True
        except (OSError, IndexError):
            continue
    return False


if not done:
    deadline = time.monotonic() + 10.0
    while owner_running() and time.monotonic() < deadline:
        time.sleep(0.02)

# After an owner that died, a lock still held may be on its way out (a file the kernel is
# still closing): look again for a moment. Held for good: another owner's (see locked()).
deadline = time.monotonic() + (0.0 if done else 2.0)
while True:
    names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    held = [n for n in names if locked(n)]
    for name in names:
        # Never-locked files (the Python backend's) go with the guard segment their name starts with.
        if name not in held and not any(name.startswith(guard + "_") for guard in held):
            unlink_unowned(name)
    if not held or time.monotonic() > deadline:
        break
    time.sleep(0.1)

# Last, and only after an owner that died: the Python backend's directory of its Triton, which
# that Triton, killed, did not remove (an owner that let go stopped its Triton itself).
if pyenv and not done:
    try:
        import shutil
        parent, _, name = pyenv.rpartition("/")
        if parent == "/tmp" and name.startswith("python_env_") and not os.path.islink(pyenv):
            shutil.rmtree(pyenv, ignore_errors=True)
    except Exception:
        pass
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


class Reaper:
    """A process that cleans up after this one when it dies (see the module docstring).

    It removes the ``/dev/shm`` entries named with this process's owner tag
    whose lock no live process holds, so it must only be started by a process
    whose segments all go with it (the node actor). It is not this process's
    child (it forks away), so a Ray that kills a killed actor's children
    leaves it running. If it dies itself, :meth:`check` starts another and
    tells it what the first knew; :meth:`state` says so.

    Raises:
        RuntimeError: The reaper did not start.
    """

    def __init__(self) -> None:
        self.prefix = f"{owner_tag()}_"
        if not self.prefix.startswith(SEGMENT_PREFIX + "_"):
            raise RuntimeError(f"unexpected owner tag {self.prefix!r}")
        self._lock = threading.Lock()
        self._triton: tuple[int, str] = (0, "")
        self._python_env = ""
        self._closed = False
        self.restarts = 0
        self.last_failure: str | None = None
        self._pid, self._start_time, self._stdin = self._launch()

    def _launch(self) -> tuple[int, int | None, Any]:
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, self.prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # signals to our process group do not reach it
        )
        line = launcher.stdout.readline() if launcher.stdout is not None else b""
        if launcher.stdout is not None:
            launcher.stdout.close()
        launcher.wait()
        if not line.strip().isdigit():
            if launcher.stdin is not None:
                launcher.stdin.close()
            raise RuntimeError("the reaper process did not start")
        pid = int(line)
        return pid, process_start_time(pid), launcher.stdin

    @property
    def pid(self) -> int:
        return self._pid

    def alive(self) -> bool:
        """Whether the reaper process still runs (the very one started: its start time matches)."""
        return self._start_time is not None and process_start_time(self._pid) == self._start_time

    def _send_locked(self) -> None:
        stdin = self._stdin
        if stdin is None or stdin.closed:
            return
        pid, marker = self._triton
        try:
            stdin.write(f"triton {pid}\nmarker {marker}\npyenv {self._python_env}\n".encode())
            stdin.flush()
        except OSError as e:
            logger.warning("reaper %d unreachable: %s", self._pid, e)

    def watch_triton(self, pid: int | None, marker: str = "") -> None:
        """Tell the reaper which Triton to kill if this process dies.

        Args:
            pid: The server's pid (its process group's id); 0 or None: none.
            marker: Text on the command line of the server and of its backend
                stubs (see :attr:`TritonServer.process_marker`); the group is
                killed only while one of its processes shows it.
        """
        with self._lock:
            self._triton = (pid or 0, marker if pid else "")
            self._python_env = ""  # a new Triton's is told once its backend makes it
            self._send_locked()

    def watch_python_env(self, path: str | None) -> None:
        """Tell the reaper the directory Triton's Python backend made for the Triton it watches
        (see :attr:`TritonServer.python_env`), removed if this process dies; ``None``: none."""
        with self._lock:
            self._python_env = path or ""
            self._send_locked()

    def check(self) -> bool:
        """Start a new reaper if this one died (and tell it what it must know). Returns whether it did.

        A reaper that cannot be started again is retried on the next call;
        :meth:`state` shows the failure meanwhile.
        """
        with self._lock:
            if self._closed or self.alive():
                return False
            failure = f"reaper (pid {self._pid}) died"
            logger.error("%s; starting another", failure)
            if self._stdin is not None:
                try:
                    self._stdin.close()
                except OSError:
                    pass
                self._stdin = None
            try:
                self._pid, self._start_time, self._stdin = self._launch()
            except (OSError, RuntimeError) as e:
                self.last_failure = f"{failure}; could not start another: {e}"
                logger.error("%s", self.last_failure)
                return False
            self.restarts += 1
            self.last_failure = f"{failure} at {time.strftime('%Y-%m-%d %H:%M:%S')}; restarted as {self._pid}"
            self._send_locked()
            return True

    def state(self) -> dict[str, object]:
        """For ``status``: the reaper's pid, whether it runs, how often it was restarted, the last failure,
        the Python-backend directory it would remove."""
        with self._lock:
            return {
                "pid": self._pid,
                "alive": self.alive(),
                "restarts": self.restarts,
                "last_failure": self.last_failure,
                "python_env": self._python_env or None,
            }

    def close(self, timeout: float = 10.0) -> None:
        """Let the reaper run now (after an orderly shutdown it finds nothing) and wait for it. Idempotent."""
        self.watch_triton(0)  # stopped already: its pid may belong to someone else by now
        with self._lock:
            self._closed = True
            stdin = self._stdin
            if stdin is not None and not stdin.closed:
                try:
                    stdin.write(b"done\n")  # no need to wait for this process to exit
                    stdin.flush()
                except OSError:
                    pass
                try:
                    stdin.close()
                except OSError:  # a dead reaper: what was still buffered for it cannot go
                    pass
        deadline = time.monotonic() + timeout
        while _running(self._pid):
            if time.monotonic() > deadline:
                logger.warning("reaper %d did not finish in %gs", self._pid, timeout)
                return
            time.sleep(0.01)
