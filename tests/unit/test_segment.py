from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.shm.segment import Segment, new_segment_name, validate_segment_name
from ray_triton_shm.errors import SharedMemoryError


def shm_path(name: str) -> str:
    return os.path.join(segment.SHM_DIR, name)


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def stray() -> Iterator[list[str]]:
    """Names of /dev/shm files a test made by hand (not owned by this process); removed afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        segment.unlink_segment(name)


def _touch(name: str, size: int = 4096) -> str:
    with open(shm_path(name), "wb") as f:
        f.truncate(size)
    return name


@pytest.fixture
def owned() -> Iterator[Segment]:
    seg = Segment.create(new_segment_name("test"), 8192)
    yield seg
    seg.close()


# -- create / attach / close -------------------------------------------------------


def test_create_makes_private_file_in_dev_shm(owned: Segment) -> None:
    path = shm_path(owned.name)
    info = os.stat(path)
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == 8192
    assert info.st_uid == os.getuid()
    assert owned.key == "/" + owned.name
    assert owned.owner is True
    assert owned.name.startswith(segment.owner_tag() + "_test_")


def test_create_ignores_permissive_umask() -> None:
    old = os.umask(0)
    try:
        seg = Segment.create(new_segment_name("test"), 4096)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(shm_path(seg.name)).st_mode) == 0o600
    finally:
        seg.close()


def test_space_is_reserved_up_front(owned: Segment) -> None:
    # posix_fallocate: the blocks exist now, not on first touch.
    assert os.stat(shm_path(owned.name)).st_blocks * 512 >= owned.size


def test_create_is_exclusive(owned: Segment) -> None:
    owned.mm[:4] = b"mine"
    with pytest.raises(SharedMemoryError, match="already exists"):
        Segment.create(owned.name, 4096)
    # The failed second create must not have removed or truncated the first.
    assert os.path.exists(shm_path(owned.name))
    assert os.stat(shm_path(owned.name)).st_size == 8192
    assert owned.mm[:4] == b"mine"


def test_create_refuses_nonpositive_size() -> None:
    name = new_segment_name("test")
    for size in (0, -1):
        with pytest.raises(SharedMemoryError):
            Segment.create(name, size)
    assert not os.path.exists(shm_path(name))


def test_create_refuses_symlink(stray: list[str], tmp_path) -> None:
    name = new_segment_name("test")
    target = tmp_path / "target"
    os.symlink(target, shm_path(name))
    stray.append(name)
    with pytest.raises(SharedMemoryError):
        Segment.create(name, 4096)
    assert not target.exists()


def test_too_large_for_dev_shm_fails_cleanly() -> None:
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    size = max(free, total) * 2 + 4096
    name = new_segment_name("test")
    with pytest.raises(SharedMemoryError) as info:
        Segment.create(name, size)
    message = str(info.value)
    assert "/dev/shm has too little space" in message
    assert str(size) in message
    assert "--shm-size" in message
    assert not os.path.exists(shm_path(name))


def test_attach_sees_owner_writes_and_back(owned: Segment) -> None:
    attached = Segment.attach(owned.name, size=8192)
    try:
        assert attached.owner is False
        assert attached.size == 8192
        owned.mm[100:105] = b"hello"
        assert attached.mm[100:105] == b"hello"
        attached.mm[0:3] = b"abc"
        assert owned.mm[0:3] == b"abc"
        view = np.frombuffer(attached.mm, dtype=np.float32, count=4, offset=64)
        np.frombuffer(owned.mm, dtype=np.float32, count=4, offset=64)[:] = [1, 2, 3, 4]
        assert view.tolist() == [1, 2, 3, 4]
        del view
    finally:
        attached.close()
    assert os.path.exists(shm_path(owned.name)), "closing an attached segment must not unlink it"


def test_attach_checks_size(owned: Segment) -> None:
    with pytest.raises(SharedMemoryError, match="expected"):
        Segment.attach(owned.name, size=8193)


def test_attach_missing_segment() -> None:
    with pytest.raises(SharedMemoryError, match="cannot attach"):
        Segment.attach(new_segment_name("missing"))


def test_owner_close_unlinks_and_is_idempotent() -> None:
    seg = Segment.create(new_segment_name("test"), 4096)
    path = shm_path(seg.name)
    assert os.path.exists(path)
    seg.close()
    assert not os.path.exists(path)
    seg.close()  # no error the second time
    assert seg.mm.closed


def test_attached_close_is_idempotent(owned: Segment) -> None:
    attached = Segment.attach(owned.name)
    attached.close()
    attached.close()
    assert os.path.exists(shm_path(owned.name))


def test_owner_close_with_live_array_still_unlinks() -> None:
    seg = Segment.create(new_segment_name("test"), 4096)
    array = np.frombuffer(seg.mm, dtype=np.uint8)
    array[:2] = [7, 9]
    seg.close()  # cannot unmap now; must not raise
    assert not os.path.exists(shm_path(seg.name))
    assert array[:2].tolist() == [7, 9]  # the mapping is still valid
    del array


def test_attached_child_process_does_not_unlink(owned: Segment) -> None:
    code = textwrap.dedent(
        f"""
        import os
        from ray_triton_shm._private.shm.segment import Segment
        seg = Segment.attach({owned.name!r}, size=8192)
        seg.mm[0:5] = b"child"
        assert seg.mm[8:12] == b"ping"
        seg.close()
        # A second attach that exits without closing at all.
        Segment.attach({owned.name!r})
        os._exit(0)
        """
    )
    owned.mm[8:12] = b"ping"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert os.path.exists(shm_path(owned.name))
    assert owned.mm[0:5] == b"child"
    # And the (still existing) segment can be attached again.
    again = Segment.attach(owned.name)
    assert again.mm[0:5] == b"child"
    again.close()


# -- names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/",
        "///",
        "a/b",
        "/rtshm_x",
        "..",
        ".",
        "x" * 201,
        "triton_python_backend_shm_region_1",
        "triton_anything",
        "has space",
        "semi;colon",
        "dollar$",
        "new\nline",
        "nul\x00byte",
        "-leading-dash",
        "_leading_underscore",
        ".hidden",
        "ümlaut",
        "star*",
    ],
)
def test_invalid_names_refused(name: str) -> None:
    with pytest.raises(SharedMemoryError):
        validate_segment_name(name)
    with pytest.raises(SharedMemoryError):
        Segment.create(name, 4096)


@pytest.mark.parametrize("name", [None, 5, b"rtshm_x"])
def test_non_string_names_refused(name: object) -> None:
    with pytest.raises(SharedMemoryError):
        validate_segment_name(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a", "x" * 200, "rtshm_1_2_pool_abc", "Model-1.shm", "9lives"])
def test_valid_names_accepted(name: str) -> None:
    validate_segment_name(name)


def test_new_segment_names_are_unique_and_tagged() -> None:
    names = {new_segment_name("pool") for _ in range(100)}
    assert len(names) == 100
    for name in names:
        validate_segment_name(name)
        assert name.startswith(segment.owner_tag() + "_pool_")


def test_owner_tag_and_start_time() -> None:
    start = segment.process_start_time(os.getpid())
    assert isinstance(start, int) and start > 0
    assert segment.owner_tag() == f"rtshm_{os.getpid()}_{start}"
    dead = _dead_pid()
    assert segment.process_start_time(dead) is None
    assert segment.owner_tag(dead) == f"rtshm_{dead}_0"


def test_unlink_with_prefix_refuses_foreign_prefix() -> None:
    for prefix in ("", "rtshm", "triton_python_backend", "rtshmx_"):
        with pytest.raises(SharedMemoryError):
            sweep.unlink_with_prefix(prefix)


def test_unlink_with_prefix(stray: list[str]) -> None:
    prefix = f"rtshm_{_dead_pid()}_0_server_{os.urandom(4).hex()}_"
    names = [_touch(prefix + str(i)) for i in range(3)]
    other = _touch(f"rtshm_{_dead_pid()}_0_other_{os.urandom(4).hex()}")
    stray.extend([*names, other])
    assert sorted(sweep.unlink_with_prefix(prefix)) == sorted(names)
    assert not any(os.path.exists(shm_path(n)) for n in names)
    assert os.path.exists(shm_path(other))


# -- stale sweep -------------------------------------------------------------------


def test_sweep_removes_dead_owner_keeps_live_ones(owned: Segment, stray: list[str]) -> None:
    token = os.urandom(8).hex()
    dead = _touch(f"{segment.owner_tag(_dead_pid())}_pool_{token}")
    # Same pid as this process but another start time: the pid was reused, the owner is gone.
    start = segment.process_start_time(os.getpid())
    reused = _touch(f"rtshm_{os.getpid()}_{start + 1}_pool_{token}")
    # A live process other than this one (our parent), with its real start time.
    parent = _touch(f"{segment.owner_tag(os.getppid())}_pool_{token}")
    # Not ours at all, and ours-but-unparseable: never touched.
    foreign = _touch(f"other_{token}")
    odd = _touch(f"rtshm_nopid_{token}")
    stray.extend([dead, reused, parent, foreign, odd])

    stale = sweep.stale_segments()
    assert dead in stale and reused in stale
    assert owned.name not in stale and parent not in stale and odd not in stale and foreign not in stale

    # Swept by the planted names' owner tags only: other test runs share this /dev/shm.
    planted = (dead, reused, parent, owned.name)
    removed = [
        name
        for prefix in {"_".join(name.split("_")[:3]) + "_" for name in planted}
        for name in sweep.sweep_stale_segments(prefix)
    ]
    assert dead in removed and reused in removed
    for name in (dead, reused):
        assert not os.path.exists(shm_path(name))
    for name in (owned.name, parent, foreign, odd):
        assert os.path.exists(shm_path(name)), name
    assert owned.name not in removed


def test_sweep_keeps_segment_of_exited_attacher(owned: Segment) -> None:
    """Only the owner's death makes a segment stale; an attacher exiting does not."""
    code = f"from ray_triton_shm._private.shm.segment import Segment; Segment.attach({owned.name!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert owned.name not in sweep.sweep_stale_segments()
    assert os.path.exists(shm_path(owned.name))


def test_segment_of_dead_creator_process_is_swept() -> None:
    code = textwrap.dedent(
        """
        import os
        from ray_triton_shm._private.shm.segment import Segment, new_segment_name
        seg = Segment.create(new_segment_name("pool"), 4096)
        print(seg.name, flush=True)
        os._exit(0)  # killed without cleanup
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True)
    name = out.stdout.strip()
    try:
        assert os.path.exists(shm_path(name))
        assert name in sweep.stale_segments()
        assert name in sweep.sweep_stale_segments()
        assert not os.path.exists(shm_path(name))
    finally:
        segment.unlink_segment(name)


# -- owner locks: liveness that holds across pid namespaces --------------------------


def _held(name: str) -> bool:
    """Whether someone holds the exclusive lock of ``name`` (tried from a fresh open file description)."""
    fd = os.open(shm_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture
def foreign_owner(stray: list[str]) -> Iterator[Callable[[str], int]]:
    """Plays an owner in another pid namespace: makes ``name`` and holds its lock on an fd it returns."""
    fds: list[int] = []

    def make(name: str) -> int:
        fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        stray.append(name)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
        return fd

    yield make
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def test_owner_holds_lock_for_the_segments_life() -> None:
    seg = Segment.create(new_segment_name("flocktest"), 4096)
    try:
        assert _held(seg.name)
        attached = Segment.attach(seg.name)  # attaching never locks, and closing an attacher keeps the lock
        attached.close()
        assert _held(seg.name)
    finally:
        seg.close()
    assert not os.path.exists(shm_path(seg.name))
    assert seg._lock_fd == -1


def test_sweep_keeps_locked_segment_whatever_its_pid_says(foreign_owner: Callable[[str], int]) -> None:
    token = os.urandom(8).hex()
    start = segment.process_start_time(os.getpid())
    # The owner's pid names nothing here, or another process (ours, with another start time).
    gone = f"{segment.owner_tag(_dead_pid())}_flocktest_{token}"
    other = f"rtshm_{os.getpid()}_{start + 1}_flocktest_{token}"
    fds = [foreign_owner(gone), foreign_owner(other)]
    assert not {gone, other} & set(sweep.stale_segments())
    assert not {gone, other} & set(sweep.sweep_stale_segments())
    assert os.path.exists(shm_path(gone)) and os.path.exists(shm_path(other))
    # The owner dies: its lock goes with it, and now both are swept.
    for fd in fds:
        os.close(fd)
    assert {gone, other} <= set(sweep.stale_segments())
    assert {gone, other} <= set(sweep.sweep_stale_segments())
    assert not os.path.exists(shm_path(gone)) and not os.path.exists(shm_path(other))


def test_unlocked_segment_of_a_live_pid_is_kept(stray: list[str]) -> None:
    """Segments never locked (older versions) are stale only if the pid says so too."""
    name = _touch(f"{segment.owner_tag(os.getppid())}_flocktest_{os.urandom(8).hex()}")
    stray.append(name)
    assert not _held(name)
    assert name not in sweep.stale_segments()
    assert name not in sweep.sweep_stale_segments()
    assert os.path.exists(shm_path(name))


def test_lock_holder_guards_the_files_under_its_prefix(
    foreign_owner: Callable[[str], int], stray: list[str]
) -> None:
    """Triton's Python backend never locks its files; the holder named by their prefix does."""
    holder = f"{segment.owner_tag(_dead_pid())}_pyb_{os.urandom(16).hex()}"
    fd = foreign_owner(holder)
    members = [_touch(f"{holder}_{suffix}") for suffix in ("add_sub_0", "x")]
    stray.extend(members)
    unguarded = _touch(f"{segment.owner_tag(_dead_pid())}_pyb_{os.urandom(16).hex()}_y")
    stray.append(unguarded)
    assert not {holder, *members} & set(sweep.sweep_stale_segments())
    assert all(os.path.exists(shm_path(n)) for n in (holder, *members))
    assert not os.path.exists(shm_path(unguarded)), "a file without a live holder must be swept"
    os.close(fd)
    assert {holder, *members} <= set(sweep.sweep_stale_segments())
    assert not any(os.path.exists(shm_path(n)) for n in (holder, *members))


def test_create_survives_a_sweep_between_open_and_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweeper in another pid namespace (where our pid means nothing) may unlink a file
    between our exclusive open and our flock; create() notices and makes it again."""
    real_lock = segment._lock_within
    swept: list[str] = []

    def sweep_first(fd: int, name: str, timeout_s: float) -> None:
        if not swept:
            real_alive = sweep._owner_alive
            with monkeypatch.context() as m:
                # As seen from a pid namespace where our pid names no live process; other
                # processes' segments are judged as usual (the machine is shared).
                m.setattr(sweep, "_owner_alive", lambda pid, st: pid != os.getpid() and real_alive(pid, st))
                swept.extend(n for n in sweep.sweep_stale_segments() if n == name)
        real_lock(fd, name, timeout_s)

    monkeypatch.setattr(segment, "_lock_within", sweep_first)
    seg = Segment.create(new_segment_name("flocktest"), 4096)
    try:
        assert swept == [seg.name], "the sweep did not take the unlocked new file"
        assert os.path.exists(shm_path(seg.name)) and _held(seg.name)
        assert os.fstat(seg._lock_fd).st_ino == os.stat(shm_path(seg.name)).st_ino
        seg.mm[:4] = b"abcd"
        with open(shm_path(seg.name), "rb") as f:
            assert f.read(4) == b"abcd"
    finally:
        seg.close()
    assert not os.path.exists(shm_path(seg.name))


def test_create_gives_up_when_swept_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    real_lock = segment._lock_within

    def always_swept(fd: int, name: str, timeout_s: float) -> None:
        os.unlink(shm_path(name))
        real_lock(fd, name, timeout_s)

    monkeypatch.setattr(segment, "_lock_within", always_swept)
    name = new_segment_name("flocktest")
    with pytest.raises(SharedMemoryError, match="removed by a sweeper"):
        Segment.create(name, 4096)
    assert not os.path.exists(shm_path(name))


def test_forked_child_does_not_keep_the_owner_lock() -> None:
    """The lock follows the owner: a child forked without exec drops its copy, so the
    segment is swept once the owner dies even though the child lives on."""
    code = textwrap.dedent(
        """
        import os, time
        from ray_triton_shm._private.shm.segment import Segment, new_segment_name
        seg = Segment.create(new_segment_name("flocktest"), 4096)
        started, running = os.pipe()
        child = os.fork()
        if child == 0:  # the fork hooks have run by now
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.write(running, b"r")
            time.sleep(60)
            os._exit(0)
        os.read(started, 1)
        print(seg.name, child, flush=True)
        os._exit(0)  # the owner dies without cleanup; its child lives on
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True)
    name, child = out.stdout.split()
    try:
        assert segment.process_start_time(int(child)) is not None, "the forked child should still run"
        assert not _held(name)
        assert name in sweep.sweep_stale_segments()
    finally:
        os.kill(int(child), signal.SIGKILL)
        segment.unlink_segment(name)


def test_children_do_not_inherit_the_owner_lock(owned: Segment) -> None:
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        targets = set()
        for fd in os.listdir(f"/proc/{child.pid}/fd"):
            try:
                targets.add(os.readlink(f"/proc/{child.pid}/fd/{fd}"))
            except FileNotFoundError:
                pass
        assert shm_path(owned.name) not in targets
        assert _held(owned.name)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
