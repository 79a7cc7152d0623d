"""The tritonserver process itself: how it is spawned, watched and killed, without reaping it early.

The server is spawned from one long-lived launcher thread (``PR_SET_PDEATHSIG``
fires when the thread that forked it exits), through a small shim that asks
the kernel to kill it when its parent dies. It leads its own process group, so
its Python-backend stubs are killed with it; its exit is observed without
reaping it, so that its pid (the group's id) cannot be reused while stubs may
live on.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import glob
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# Runs between fork and exec of tritonserver: ask the kernel to SIGKILL it when
# we die, then make sure we had not died already. Safer than preexec_fn in a
# threaded parent (Ray workers are). Ignored or blocked signals survive exec,
# and Ray workers ignore SIGINT, so SIGINT is made to work again here.
PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the
# process. Servers are therefore spawned from one daemon thread that lives as
# long as the process, so that start() may be called from any thread.
_launcher_lock = threading.Lock()
_launcher: tuple[int, queue.SimpleQueue[Any]] | None = None


def _launcher_loop(jobs: queue.SimpleQueue[Any]) -> None:
    while True:
        done, args, kwargs = jobs.get()
        try:
            done.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)


def popen_from_launcher(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher[0] != os.getpid():  # none yet, or we were forked
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            threading.Thread(
                target=_launcher_loop, args=(jobs,), name="tritonserver-launcher", daemon=True
            ).start()
            _launcher = (os.getpid(), jobs)
        jobs = _launcher[1]
    done: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
    jobs.put((done, args, kwargs))
    return done.result()


def exit_code(proc: subprocess.Popen[bytes]) -> int | None:
    """``proc``'s return code (as :attr:`subprocess.Popen.returncode`) if it exited; None while it runs.

    Never reaps it: an exited server stays a zombie until :func:`kill_group`, so
    its pid, which is its process group's id, cannot be handed to another process
    while its backend stubs may still live in that group.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped behind our back (SIGCHLD ignored): Popen knows the rest
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit, without reaping it. Returns whether it did."""
    deadline = time.monotonic() + timeout
    while exit_code(proc) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (its Python-backend stubs), dead leader or not; then reap it.

    The server leads its own group (``start_new_session``). Until it is reaped
    here, its pid (the group id) is ours even if it died: stubs that outlive a
    crashed server are killed with it, and no reused group can be hit.
    """
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def kill_group_leftovers(pgid: int) -> list[int]:
    """SIGKILL what is left of an exited server's process group: its Triton processes only.

    The server led the group; once it is gone its stubs may live on in it. Only
    processes of that group whose command line names Triton are killed, so a pid
    reused after the group emptied is never hit.

    Returns:
        The pids killed.
    """
    killed = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return killed
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and b"triton" in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    if killed:
        logger.info(
            "killed %d process(es) left in the group of tritonserver %d: %s", len(killed), pgid, killed
        )
    return killed


PYTHON_ENV_DIRS = "/tmp/python_env_*"
"""Where Triton's Python backend makes a directory of its own when it loads (a fixed path, not
``TMPDIR``): the backend removes it when the server exits cleanly, and leaves it when the server
is killed."""


def python_env_dirs() -> set[str]:
    """Every Python-backend directory on this machine now (see :data:`PYTHON_ENV_DIRS`)."""
    return set(glob.glob(PYTHON_ENV_DIRS))


def loads_python_backend(pid: int) -> bool:
    """Whether process ``pid`` has Triton's Python backend loaded (``False`` when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libtriton_python.so" in line for line in maps)
    except OSError:
        return False


def own_python_env(pid: int, before: set[str]) -> str | None:
    """The Python-backend directory server ``pid`` made since ``before`` (a :func:`python_env_dirs`
    taken before it was launched), or ``None``: no backend loaded, or not exactly one new
    directory (another server started meanwhile: none is taken for this one's)."""
    if not loads_python_backend(pid):
        return None
    made = python_env_dirs() - before
    return made.pop() if len(made) == 1 else None


PYTHON_ENV_TURN_LOCK = os.path.dirname(PYTHON_ENV_DIRS)
"""What launches of this machine take turns on (see :class:`PythonEnvTurn`): the directory the
backend makes its own in, locked itself (no lock file is left behind)."""
PYTHON_ENV_TURN_S = 15.0
"""The longest a launch holds its turn, and the longest it waits for one."""


class PythonEnvTurn:
    """A server launch's turn to make its Python-backend directory, so that it can tell which is its own.

    The backend names its directory at random in ``/tmp``: a server started beside another
    cannot tell the two new directories apart. Launches through this class take turns
    (an ``flock`` of :data:`PYTHON_ENV_TURN_LOCK`) from just before the launch until
    their directory appears, the server is ready or fails, or ``hold_s`` passes, so that
    the one new directory seen meanwhile is the launch's own. A launch that waited
    ``hold_s`` for its turn goes on without one (and takes a directory only when exactly
    one new one appeared, as without turns). A context manager; :meth:`close` is idempotent.

    Args:
        hold_s: The longest the turn is held, and the longest it is waited for.
        lock_path: What is locked (a directory or a file).
    """

    def __init__(self, hold_s: float = PYTHON_ENV_TURN_S, lock_path: str = PYTHON_ENV_TURN_LOCK) -> None:
        self.path: str | None = None
        self._fd: int | None = None
        deadline = time.monotonic() + hold_s
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            logger.debug("no turn for the Python backend's directory: %s", e)
        else:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    os.close(fd)
                else:
                    self._fd = fd
                break
        self._before = python_env_dirs()
        self._until = time.monotonic() + hold_s

    @property
    def held(self) -> bool:
        """Whether the turn is still held."""
        return self._fd is not None

    def look(self, pid: int) -> None:
        """While the turn is held, take server ``pid``'s directory if it has appeared; let the turn go
        once it has, or once ``hold_s`` has passed."""
        if self._fd is None:
            return
        self.path = own_python_env(pid, self._before)  # held: not found yet
        if self.path is not None or time.monotonic() > self._until:
            self.close()

    def finish(self, pid: int) -> str | None:
        """The directory of server ``pid``, now ready (``None``: none, or not known for sure); the turn
        is let go."""
        if self.path is None:
            self.path = own_python_env(pid, self._before)
        self.close()
        return self.path

    def close(self) -> None:
        """Let the turn go. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the flock goes with it

    def __enter__(self) -> PythonEnvTurn:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def remove_python_env(path: str) -> None:
    """Remove the Python-backend directory of a server that is gone (its own exit removes it when clean)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed %s, left by a tritonserver that did not exit cleanly", path)
