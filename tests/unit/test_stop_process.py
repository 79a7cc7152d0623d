"""tests.helpers.stop_process: returns only once every thread of the process has stopped."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.helpers import stop_process, thread_states

_BUSY = """
import threading
def spin():
    while True:
        pass
for _ in range(6):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
spin()
"""


def test_every_thread_is_stopped_when_it_returns() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"spinning\n"
        assert "R" in thread_states(child.pid)
        for _ in range(5):
            stop_process(child.pid)
            states = thread_states(child.pid)
            assert len(states) == 7 and set(states) == {"T"}, states
            child.send_signal(signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert thread_states(child.pid) == []
