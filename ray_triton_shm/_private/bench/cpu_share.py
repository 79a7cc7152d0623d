"""CPU time by process during a benchmark cell: where a front-door call's milliseconds go.

Every process's user + system time is read from ``/proc`` before and after a
cell; the difference, per call, is summed by group: the callers (the benchmark's
own caller processes, or perf_analyzer), the Serve replicas, the proxies in front
of them (Serve's proxy actors, HAProxy), the node's Triton (with its Python
backend stubs), and the rest (Ray's own processes, the kernel's threads). Given a
root, a snapshot holds only that process and its descendants (a run's own Ray and
Triton, not those of another run on the same machine).
"""

from __future__ import annotations

import os
from collections.abc import Collection

GROUPS = ("callers", "replicas", "proxy", "triton", "rest")
_TICKS = os.sysconf("SC_CLK_TCK")


def snapshot(root: int | None = None) -> dict[int, tuple[float, str]]:
    """Every process's CPU seconds so far and what it runs (command line, or name for a kernel thread).

    Args:
        root: Only this process and its descendants (None: every process).
    """
    out: dict[int, tuple[float, str]] = {}
    parents: dict[int, int] = {}
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
        parents[int(entry)] = int(fields[1])
    if root is None:
        return out
    keep = descendants(root, parents)
    return {pid: value for pid, value in out.items() if pid in keep}


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    """``root`` and every process below it, from each process's parent (``parents``: pid -> ppid)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_of(pid: int, what: str, callers: Collection[int]) -> str:
    """The group of process ``pid`` running ``what``."""
    if pid in callers or "perf_analyzer" in what:
        return "callers"
    if "ServeReplica" in what:
        return "replicas"
    if "ProxyActor" in what or what.startswith("haproxy"):
        return "proxy"
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
