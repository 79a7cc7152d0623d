"""What a process holds (RSS, open fds, TCP peers), for the leak checks of case 10 and connection counts.

A Ray worker opens connections of its own on Ray's schedule, not ours: the core
worker connects to the node's metrics agent once that agent is up, seconds after
the worker starts, later on a loaded machine. Such a socket is not a leak of ours,
so the check of an actor counts a socket only when it is a TCP connection to
Triton, the one peer our code talks to, and every other kind of descriptor
(files, /dev/shm segments, pipes, event fds) always.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Footprint:
    """Resident memory and the targets of the counted file descriptors of one process."""

    rss_kb: int
    fds: tuple[str, ...]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def fd_targets(pid: int) -> list[str]:
    """What each open fd of ``pid`` points at (``readlink`` of /proc/<pid>/fd/<n>)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed while listing
            continue
    return targets


ESTABLISHED = "01"  # the state column of /proc/net/tcp


def tcp_peers(pid: int) -> dict[str, tuple[int, str]]:
    """Socket inode -> (remote port, state) for the TCP sockets in ``pid``'s network namespace."""
    peers: dict[str, tuple[int, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)  # header
                for line in f:
                    fields = line.split()
                    peers[fields[9]] = (int(fields[2].rsplit(":", 1)[1], 16), fields[3])
        except FileNotFoundError:  # no IPv6 on this host
            continue
    return peers


def socket_inode(target: str) -> str | None:
    """The inode of an fd target ``socket:[<inode>]``, None for anything else."""
    return target[8:-1] if target.startswith("socket:[") else None


def triton_ports(*urls: str) -> frozenset[int]:
    """The ports of Triton's endpoints, from ``host:port`` or ``scheme://host:port`` strings."""
    return frozenset(urlsplit(url if "//" in url else f"//{url}").port or 0 for url in urls)


def process_footprint(
    pid: int, *, sockets_to: frozenset[int] | None = None, steady_s: float = 0.0
) -> Footprint:
    """RSS and counted fds of ``pid``.

    Args:
        pid: The process.
        sockets_to: When given, a socket counts only if it is a TCP connection to
            one of these ports (see the module docstring); when None, every fd counts.
        steady_s: When above 0, look twice this far apart and count only what was
            open both times: a leaked fd stays, while a connection of the moment
            (the node actor's health probe of Triton: fresh connections every
            half second, each living milliseconds) is gone by the second look.
    """
    targets = fd_targets(pid)
    if steady_s > 0:
        time.sleep(steady_s)
        still_open = Counter(fd_targets(pid))
        kept = []
        for target in targets:
            if still_open[target] > 0:
                still_open[target] -= 1
                kept.append(target)
        targets = kept
    if sockets_to is not None:
        peers = tcp_peers(pid)

        def counted(target: str) -> bool:
            inode = socket_inode(target)
            return inode is None or (inode in peers and peers[inode][0] in sockets_to)

        targets = [t for t in targets if counted(t)]
    return Footprint(rss_kb=_rss_kb(pid), fds=tuple(sorted(targets)))


def assert_flat(label: str, before: Footprint, after: Footprint) -> None:
    """RSS within 2% and not one more counted file descriptor (the new ones are named)."""
    grew = f"{label}: RSS grew from {before.rss_kb} kB to {after.rss_kb} kB"
    assert after.rss_kb <= before.rss_kb * 1.02, grew
    added = sorted(set(after.fds) - set(before.fds))
    assert len(after.fds) <= len(before.fds), (
        f"{label}: open fds grew from {len(before.fds)} to {len(after.fds)}; new: {added}"
    )
