"""The replica's malloc thresholds: large buffers freed go back to the system, glibc's way refused or kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm._private.serve.net.malloc_thresholds import MAX_MMAP_THRESHOLD, set_malloc_thresholds
from ray_triton_shm.errors import ConfigError

# In a process of its own (the thresholds are the process's): 16 MiB buffers made and freed
# three times, and how much of them the process still holds after.
_KEPT_AFTER_FREE = """
import sys
from ray_triton_shm._private.serve.net.malloc_thresholds import set_malloc_thresholds

def rss_anon_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

taken = set_malloc_thresholds(int(sys.argv[1]))
before = rss_anon_kib()
for _ in range(3):
    buffer = bytearray(16 << 20)
    del buffer
print(taken, (rss_anon_kib() - before) // 1024)
"""


def _kept_mib(threshold: int) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _KEPT_AFTER_FREE, str(threshold)], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_fixed_threshold_gives_large_freed_buffers_back() -> None:
    taken, kept = _kept_mib(1 << 20)
    assert taken and kept < 4, kept


def test_glibcs_own_threshold_keeps_them_which_is_what_the_setting_is_for() -> None:
    taken, kept = _kept_mib(0)
    assert not taken and kept >= 15, kept  # the second buffer came from the heap and stayed


@pytest.mark.parametrize("value", [-1, MAX_MMAP_THRESHOLD + 1, 1.5, True])
def test_thresholds_out_of_range_are_refused(value) -> None:
    with pytest.raises(ValueError, match="mmap_threshold"):
        set_malloc_thresholds(value)
    with pytest.raises(ConfigError, match="malloc_mmap_threshold_bytes"):
        FrontDoorConfig(http_port=0, malloc_mmap_threshold_bytes=value)


def test_the_setting_comes_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FrontDoorConfig(http_port=0).malloc_mmap_threshold_bytes == 1 << 20
    monkeypatch.setenv("RAY_TRITON_SHM_FRONTDOOR_MALLOC_MMAP_THRESHOLD_BYTES", "0")
    assert FrontDoorConfig(http_port=0).malloc_mmap_threshold_bytes == 0
    assert FrontDoorConfig(http_port=0, malloc_mmap_threshold_bytes=4096).malloc_mmap_threshold_bytes == 4096
