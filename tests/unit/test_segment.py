from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from ray_triton_shm._private import segment
from ray_triton_shm._private.segment import Segment, new_segment_name, validate_segment_name
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
        segment._unlink_quietly(name)


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
        from ray_triton_shm._private.segment import Segment
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
            segment.unlink_with_prefix(prefix)


def test_unlink_with_prefix(stray: list[str]) -> None:
    prefix = f"rtshm_{_dead_pid()}_0_server_{os.urandom(4).hex()}_"
    names = [_touch(prefix + str(i)) for i in range(3)]
    other = _touch(f"rtshm_{_dead_pid()}_0_other_{os.urandom(4).hex()}")
    stray.extend([*names, other])
    assert sorted(segment.unlink_with_prefix(prefix)) == sorted(names)
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

    stale = segment.stale_segments()
    assert dead in stale and reused in stale
    assert owned.name not in stale and parent not in stale and odd not in stale and foreign not in stale

    # Swept by the planted names' owner tags only: other test runs share this /dev/shm.
    planted = (dead, reused, parent, owned.name)
    removed = [
        name
        for prefix in {"_".join(name.split("_")[:3]) + "_" for name in planted}
        for name in segment.sweep_stale_segments(prefix)
    ]
    assert dead in removed and reused in removed
    for name in (dead, reused):
        assert not os.path.exists(shm_path(name))
    for name in (owned.name, parent, foreign, odd):
        assert os.path.exists(shm_path(name)), name
    assert owned.name not in removed


def test_sweep_keeps_segment_of_exited_attacher(owned: Segment) -> None:
    """Only the owner's death makes a segment stale; an attacher exiting does not."""
    code = f"from ray_triton_shm._private.segment import Segment; Segment.attach({owned.name!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert owned.name not in segment.sweep_stale_segments()
    assert os.path.exists(shm_path(owned.name))


def test_segment_of_dead_creator_process_is_swept() -> None:
    code = textwrap.dedent(
        """
        import os
        from ray_triton_shm._private.segment import Segment, new_segment_name
        seg = Segment.create(new_segment_name("pool"), 4096)
        print(seg.name, flush=True)
        os._exit(0)  # killed without cleanup
        """
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True)
    name = out.stdout.strip()
    try:
        assert os.path.exists(shm_path(name))
        assert name in segment.stale_segments()
        assert name in segment.sweep_stale_segments()
        assert not os.path.exists(shm_path(name))
    finally:
        segment._unlink_quietly(name)
