"""Shared by every test: the run fails if it leaves shared memory or Triton processes behind.

At session start this records the ``rtshm*`` entries of /dev/shm and the
processes whose command line contains ``tritonserver`` (the server, its
start-up shim and the Python-backend stubs, which live under
``.../tritonserver/backends``), and puts a marker in the environment that
every process started from here inherits. At session end (after every other
fixture, Ray's included, has been torn down) it waits a little for stragglers,
then fails the run if

* a new ``rtshm*`` entry is left whose owner (the pid and start time in its
  name) belongs to this session, or is gone and started after this session, or
* a new ``tritonserver`` process started by this session (it carries the
  marker, or descends from this process) is still running.

What it finds is reported, then removed, so one failing run does not poison
the next. Segments and servers of other sessions running at the same time
are left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import uuid

import pytest

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "rtshm"
TRITON_WORD = b"tritonserver"
SESSION_MARKER = "RAY_TRITON_SHM_TEST_SESSION"
# Python-backend stubs notice their server is gone within a few seconds.
GRACE_S = 20.0
_OWNER_RE = re.compile(rf"^{SEGMENT_PREFIX}_(\d+)_(\d+)_")
# Tests send tiny tensors and mean to exercise shared memory: below the default
# PoolConfig.min_shm_bytes (64 KiB) they would go over gRPC. Set before any
# config is built, and inherited by the Ray workers and Serve replicas started
# from here; tests of the size switch pass min_shm_bytes explicitly.
os.environ.setdefault("RAY_TRITON_SHM_MIN_SHM_BYTES", "0")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    seen = set()
    while pid > 1 and pid not in seen:
        if pid in ancestors:
            return True
        seen.add(pid)
        fields = _stat_fields(pid)
        if fields is None:
            return False
        pid = int(fields[1])
    return False


def _descends_from_us(pid: int) -> bool:
    return _descends_from(pid, {os.getpid()})


def _has_marker(pid: int, token: str) -> bool:
    environ = _read(f"/proc/{pid}/environ") or b""
    return f"{SESSION_MARKER}={token}".encode() in environ.split(b"\0")


def _ours(pid: int, token: str) -> bool:
    return pid == os.getpid() or _has_marker(pid, token) or _descends_from_us(pid)


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:
        return set()


def _triton_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        cmdline = _read(f"/proc/{entry}/cmdline")
        if cmdline and TRITON_WORD in cmdline and _running(int(entry)):
            pids.add(int(entry))
    return pids


def _start_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def _leftover_segments(before: set[str], token: str) -> list[str]:
    session_start = _start_ticks(os.getpid())
    left = []
    for name in sorted(_segments() - before):
        m = _OWNER_RE.match(name)
        if m:
            owner, owner_start = int(m.group(1)), int(m.group(2))
            # Not ours to judge: a live owner outside this session (another test run or a
            # service), or an owner that started before this session did.
            if _running(owner) and not _ours(owner, token):
                continue
            if 0 < owner_start < session_start:
                continue
        left.append(name)
    return left


def _leftover_processes(before: set[int], token: str) -> dict[int, str]:
    left = {}
    for pid in sorted(_triton_pids() - before):
        if _ours(pid, token):
            cmdline = (_read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ")
            left[pid] = cmdline.decode("utf-8", "replace")[:300]
    return left


def _backend_prefixes(pids: set[int]) -> tuple[str, ...]:
    """The Python backend's segment prefixes of the servers ``pids`` (from their command lines)."""
    prefixes = []
    for pid in pids:
        for arg in (_read(f"/proc/{pid}/cmdline") or b"").split(b"\0"):
            _, found, prefix = arg.decode("utf-8", "replace").partition("shm-region-prefix-name=")
            if found and prefix:
                prefixes.append(prefix)
    return tuple(prefixes)


def _backend_segment(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``name`` is a Python-backend file of a server with one of ``prefixes``, or the
    locked segment guarding them, named by the prefix less its final ``_`` (``TritonServer``)."""
    return any(name.startswith(prefix) or name == prefix.removesuffix("_") for prefix in prefixes)


def _wait_for_leftovers(
    segments_before: set[str], triton_before: set[int], token: str, grace_s: float, spared: set[int]
) -> tuple[list[str], dict[int, str]]:
    deadline = time.monotonic() + grace_s
    spared_prefixes = _backend_prefixes(spared)
    while True:
        segments = [
            name
            for name in _leftover_segments(segments_before, token)
            if not _backend_segment(name, spared_prefixes)
        ]
        processes = {
            pid: cmdline
            for pid, cmdline in _leftover_processes(triton_before, token).items()
            if not _descends_from(pid, spared)
        }
        if (not segments and not processes) or time.monotonic() > deadline:
            return segments, processes
        time.sleep(0.2)


def _remove_and_fail(segments: list[str], processes: dict[int, str], what: str) -> None:
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    lines = [f"{what} left resources behind (now removed):"]
    lines += [f"  /dev/shm/{name}" for name in segments]
    lines += [f"  pid {pid}: {cmdline}" for pid, cmdline in processes.items()]
    pytest.fail("\n".join(lines), pytrace=False)


@pytest.fixture(scope="session")
def session_lived_pids() -> set[int]:
    """Servers that session-scoped fixtures keep across modules add their pid here: the
    per-module check leaves them, their descendants (Python-backend stubs) and their
    Python-backend segments (and the segment guarding those) alone; the session check
    does not."""
    return set()


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_shm_or_tritonserver(request: pytest.FixtureRequest, session_lived_pids: set[int]):
    """The session check, per module: a leak is charged to the module that made it.

    At session end alone a dead process's segments can be missed: the next server
    start in a later module sweeps them first. Same ownership rules as the session
    check (other sessions' segments and servers are left alone).
    """
    token = os.environ.get(SESSION_MARKER, "")
    segments_before = _segments()
    triton_before = _triton_pids()
    yield
    segments, processes = _wait_for_leftovers(
        segments_before, triton_before, token, GRACE_S, session_lived_pids
    )
    if segments or processes:
        _remove_and_fail(segments, processes, f"module {request.module.__name__}")


@pytest.fixture(scope="session", autouse=True)
def _session_leaves_no_shm_or_tritonserver():
    """Fail the run if it leaves /dev/shm/rtshm* entries or tritonserver processes behind."""
    token = uuid.uuid4().hex
    os.environ[SESSION_MARKER] = token
    segments_before = _segments()
    triton_before = _triton_pids()
    yield
    segments, processes = _wait_for_leftovers(segments_before, triton_before, token, GRACE_S, set())
    os.environ.pop(SESSION_MARKER, None)
    if segments or processes:
        _remove_and_fail(segments, processes, "the test session")
