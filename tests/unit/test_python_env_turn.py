"""PythonEnvTurn: server launches take turns until their Python-backend directories appear."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

from ray_triton_shm._private.triton.process import PythonEnvTurn

# Maps a file named as Triton's Python backend, as a server that loaded it does.
_MAPS_BACKEND = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_second_launch_waits_for_the_first_ones_turn_to_end(tmp_path) -> None:
    first = PythonEnvTurn(hold_s=30, lock_path=str(tmp_path))
    turns: list[PythonEnvTurn] = []
    waiting = threading.Thread(target=lambda: turns.append(PythonEnvTurn(hold_s=30, lock_path=str(tmp_path))))
    try:
        assert first.held
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive(), "the second turn was given while the first was held"
        first.close()
        first.close()  # idempotent
        waiting.join(10)
        assert not waiting.is_alive() and turns[0].held
    finally:
        first.close()
        waiting.join(10)
        for turn in turns:
            turn.close()
    assert not turns[0].held


def test_a_launch_goes_on_without_a_turn_it_waited_too_long_for(tmp_path) -> None:
    with PythonEnvTurn(hold_s=30, lock_path=str(tmp_path)) as first:
        started = time.monotonic()
        with PythonEnvTurn(hold_s=0.3, lock_path=str(tmp_path)) as second:
            assert not second.held and time.monotonic() - started >= 0.3
        assert first.held


def test_a_turn_is_let_go_once_its_time_has_passed(tmp_path) -> None:
    with PythonEnvTurn(hold_s=0.2, lock_path=str(tmp_path)) as turn:
        turn.look(os.getpid())  # this process has no Python backend: nothing is taken
        assert turn.held and turn.path is None
        time.sleep(0.3)
        turn.look(os.getpid())
        assert not turn.held and turn.path is None
        assert PythonEnvTurn(hold_s=0.1, lock_path=str(tmp_path)).held  # the next one gets it at once


def test_a_turn_takes_the_one_directory_made_by_a_process_with_the_backend_loaded(tmp_path) -> None:
    library = tmp_path / "libtriton_python.so"
    library.write_bytes(b"\0" * 4096)
    server = subprocess.Popen(
        [sys.executable, "-c", _MAPS_BACKEND, str(library)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    made = None
    try:
        assert server.stdout is not None and server.stdout.readline() == b"mapped\n"
        # The real turn (/tmp itself): servers launched meanwhile wait, so no other directory appears.
        with PythonEnvTurn(hold_s=10) as turn:
            turn.look(server.pid)
            assert turn.held and turn.path is None  # nothing made yet
            made = tempfile.mkdtemp(prefix="python_env_", dir="/tmp")
            turn.look(server.pid)
            assert turn.path == made and not turn.held  # found: the turn is let go at once
        with PythonEnvTurn(hold_s=10) as other:
            assert other.finish(os.getpid()) is None  # no backend loaded: none is taken
            assert not other.held
    finally:
        server.communicate(b"", timeout=10)
        if made is not None:
            os.rmdir(made)
