"""CPU time by process during a benchmark cell: where a front-door call's milliseconds go.

Every process's user + system time is read from ``/proc`` before and after a
cell; the difference, per call, is summed by group: the callers (the benchmark's
own caller processes), the Serve replicas, the node's Triton (with its Python
backend stubs), and the rest (Ray's own processes, the kernel's threads).
"""

from __future__ import annotations

import os
from collections.abc import Collection

GROUPS = ("callers", "replicas", "triton", "rest")
_TICKS = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[float, str]]:
    """Every process's CPU seconds so far and what it runs (command line, or name for a kernel thread)."""
    out: dict[int, tuple[float, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry)] = ((int(fields[11]) + int(fields[12])) / _TICKS, f"{name} {cmd}")
    return out


def group_of(pid: int, what: str, callers: Collection[int]) -> str:
    """The group of process ``pid`` running ``what``."""
    if pid in callers:
        return "callers"
    if "ServeReplica" in what:
        return "replicas"
    if "tritonserver" in what or "triton_python_backend_stub" in what:
        return "triton"
    return "rest"


def cpu_by_group(
    before: dict[int, tuple[float, str]], after: dict[int, tuple[float, str]], callers: Collection[int]
) -> dict[str, float]:
    """CPU seconds spent between two snapshots, by group (processes started meanwhile count whole)."""
    spent = dict.fromkeys(GROUPS, 0.0)
    for pid, (seconds, what) in after.items():
        spent[group_of(pid, what, callers)] += seconds - before.get(pid, (0.0, ""))[0]
    return spent
