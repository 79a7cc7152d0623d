"""Small races: the demo's log directory, and kill_triton during a restart."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ray_triton_shm._private.cli import demo_log


def _private_dir_of(path: Path) -> os.stat_result:
    info = os.lstat(path.parent)
    assert stat.S_ISDIR(info.st_mode), f"{path.parent} is not a directory of its own"
    assert info.st_uid == os.getuid(), f"{path.parent} belongs to uid {info.st_uid}"
    assert stat.S_IMODE(info.st_mode) == 0o700, f"{path.parent} has mode {stat.S_IMODE(info.st_mode):o}"
    return info


def test_the_demo_log_goes_to_a_private_directory_even_if_another_user_made_the_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / "ray-triton-shm"
    shared.mkdir()
    shared.chmod(0o777)  # made first by someone else, open to all
    path = demo_log.demo_log_path()
    _private_dir_of(path)
    assert shared not in path.parents, "the log went into a directory others can write"
    assert demo_log.demo_log_path().parent == path.parent  # the same directory each run


def test_the_demo_log_directory_is_not_one_planted_for_us(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    first = demo_log.demo_log_path().parent
    first.rmdir()
    first.symlink_to(elsewhere)  # the predictable per-user name, planted as a link
    path = demo_log.demo_log_path()
    _private_dir_of(path)
    assert elsewhere not in path.resolve().parents and path.parent != first
    first.unlink()
    loose = first
    loose.mkdir(mode=0o755)  # or as a directory others can read
    loose.chmod(0o755)
    path = demo_log.demo_log_path()
    _private_dir_of(path)
    assert path.parent != loose


def test_kill_triton_never_signals_a_server_that_a_restart_is_replacing() -> None:
    from ray_triton_shm._private.node.node_actor import _NodeActor

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    old, new = subprocess.Popen(sleeper), subprocess.Popen(sleeper)

    class Server:
        pid = old.pid

    actor = object.__new__(_NodeActor)  # only what kill_triton uses: no Ray, no Triton
    actor._server = Server()
    actor._restart_lock = threading.Lock()
    killed: list[int] = []
    try:
        actor._restart_lock.acquire()  # a restart is under way: the old server is going
        caller = threading.Thread(target=lambda: killed.append(actor.kill_triton()))
        caller.start()
        time.sleep(0.3)
        assert old.poll() is None and not killed, "kill_triton signalled the server being replaced"
        old.kill()  # the restart stops the old server (its pid may now be reused) ...
        old.wait()
        Server.pid = new.pid  # ... and starts the new one
        actor._restart_lock.release()
        caller.join(10)
        assert killed == [new.pid] and new.wait(10) == -9
    finally:
        for proc in (old, new):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
