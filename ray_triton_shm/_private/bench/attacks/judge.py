"""One attack judged: legitimate callers before, during and after it, and the server's memory meanwhile.

``held``: during the attack and until the callers are served again, no
legitimate call failed or got a wrong answer, and no protocol went longer
without a right answer than :attr:`Bounds.gap_floor_s` or
:attr:`Bounds.gap_factor` times the longest gap of the quiet time just before
(the same run, so a loaded machine raises the bar for both); every server
process grew by less than :attr:`Bounds.rss_mib` and is still there; callers
were served again within :attr:`Bounds.recover_s` of the attack's end. A
protocol fault must be refused (4xx or closed); at most
:attr:`Bounds.reset_ran_share` of the calls reset by their client may run.
Otherwise ``broke``, with the reasons.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ray_triton_shm._private.bench.attacks.catalog import Attack
from ray_triton_shm._private.bench.attacks.legit import PROTOCOLS, LegitCallers, longest_gap
from ray_triton_shm._private.bench.attacks.wire import Target

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """What an attack may cost and still count as held; how long it lasts.

    Attributes:
        hold_s: How long the attack holds what it opened.
        quiet_s: The quiet time before it (the baseline gap).
        gap_floor_s: A gap of legitimate calls up to this long is never an outage.
        gap_factor: ...nor up to this many times the baseline's longest gap.
        rss_mib: Most a server process's private memory may grow (RssAnon) during the attack and recovery.
        recover_s: Callers must be served again within this after the attack's end.
        reset_ran_share: Most of the reset calls that may still run.
        scale: Multiplies the attacks' counts (1: the table's).
        settle_s: Before its quiet time, an attack waits (this long at most) for a right answer
            of each protocol, so what the attack before it left behind is not counted against it.
    """

    hold_s: float = 6.0
    quiet_s: float = 2.0
    gap_floor_s: float = 3.0
    gap_factor: float = 3.0
    rss_mib: float = 256.0
    recover_s: float = 20.0
    reset_ran_share: float = 0.05
    scale: float = 1.0
    settle_s: float = 60.0


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One attack on one server.

    Attributes:
        attack / kind / protocol: Which attack.
        target: ``frontdoor`` or ``triton``.
        held: Whether the server held (see the module).
        reasons: Why it broke (empty when held).
        gap_s: The longest gap of right legitimate answers during the attack (either protocol).
        baseline_gap_s: The same in the quiet time before.
        calls: Legitimate calls that ended during the attack and recovery.
        failed: Of these, how many failed (errors, wrong answers excluded).
        wrong: Of these, how many got a wrong answer.
        rss_growth_mib: The most any server process grew.
        recovered_s: Seconds after the attack's end until both protocols were served (None: not within
            ``recover_s``).
        gaps_s: The longest gap of each protocol during the attack.
        notes: What the attack saw.
        errors: A few of the legitimate callers' errors.
    """

    attack: str
    kind: str
    protocol: str
    target: str
    held: bool
    reasons: tuple[str, ...]
    gap_s: float
    baseline_gap_s: float
    calls: int
    failed: int
    wrong: int
    rss_growth_mib: float
    recovered_s: float | None
    gaps_s: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    errors: tuple[str, ...] = ()


def private_rss(pid: int) -> int | None:
    """``RssAnon`` of ``pid`` in bytes, its private resident memory (None: gone).

    Not ``VmRSS``: that counts the slots' shared memory too, whose pages a replica touches
    as calls fill its slots (the pools' size, not what a client makes it hold).
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def listening_pids(port: int) -> list[int]:
    """The processes that hold a socket listening on TCP ``port`` (every replica of the app: they
    share one listening socket, so each holds a descriptor of it)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    pids.add(int(entry))
                    break
            except OSError:
                continue
    return sorted(pids)


class _RssWatch:
    """The highest ``RssAnon`` of each process, sampled every 0.1 s from start to stop."""

    def __init__(self, pids: list[int]) -> None:
        self.before = {p: private_rss(p) or 0 for p in pids}
        self.peak = dict(self.before)
        self.gone: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.1):
            for pid in self.before:
                rss = private_rss(pid)
                if rss is None:
                    self.gone.add(pid)
                else:
                    self.peak[pid] = max(self.peak[pid], rss)

    def stop(self) -> float:
        """Stop; the most any process grew, in MiB."""
        self._done.set()
        self._thread.join()
        return max((self.peak[p] - self.before[p]) / MiB for p in self.before) if self.before else 0.0


def judge(attack: Attack, target: Target, callers: LegitCallers, pids: list[int], bounds: Bounds) -> Verdict:
    """Run ``attack`` on ``target`` while ``callers`` (already started, on ``target``) call; its verdict.

    ``pids``: the server's processes whose memory counts.
    """
    settle_until = time.time() + bounds.settle_s  # what an attack before left behind must be over
    settled = time.time()
    while time.time() < settle_until and not all(callers.served_since(settled, p) for p in PROTOCOLS):
        time.sleep(0.05)
    quiet_start = time.time()
    time.sleep(bounds.quiet_s)
    start = time.time()
    calls = callers.snapshot()
    baseline = max(longest_gap(calls, p, quiet_start, start) for p in PROTOCOLS)
    watch = _RssWatch(pids)
    try:
        notes = attack.run(target, time.monotonic() + bounds.hold_s, bounds.scale)
    except Exception as e:
        notes = {"attack error": f"{type(e).__name__}: {e}"}
    end = time.time()
    deadline = end + bounds.recover_s
    while time.time() < deadline and not all(callers.served_since(end, p) for p in PROTOCOLS):
        time.sleep(0.05)
    recovered_s = None
    calls = callers.snapshot()
    served = [
        min((c.end for c in calls if c.ok and c.protocol == p and c.start >= end), default=None)
        for p in PROTOCOLS
    ]
    if all(s is not None for s in served):
        recovered_s = max(served) - end
    growth = watch.stop()
    window = [c for c in calls if start <= c.end <= (end + (recovered_s or bounds.recover_s))]
    failed = [c for c in window if not c.ok and c.error != "wrong answer"]
    wrong = [c for c in window if c.error == "wrong answer"]
    gaps = {p: round(longest_gap(calls, p, start, end), 2) for p in PROTOCOLS}
    gap = max(gaps.values())
    reasons = []
    allowed = max(bounds.gap_floor_s, bounds.gap_factor * baseline)
    for protocol, protocol_gap in gaps.items():
        if protocol_gap > allowed:
            reasons.append(f"{protocol} outage {protocol_gap:.1f} s")
    if failed:
        reasons.append(f"{len(failed)} failed calls")
    if wrong:
        reasons.append(f"{len(wrong)} wrong answers")
    if growth > bounds.rss_mib:
        reasons.append(f"RSS +{growth:.0f} MiB")
    if watch.gone:
        reasons.append("server process gone")
    if recovered_s is None:
        reasons.append(f"not served again within {bounds.recover_s:.0f} s")
    if attack.kind == "protocol" and not notes.get("refused", False):
        reasons.append(f"accepted ({notes.get('answer')})")
    if "ran" in notes and notes["ran"] > bounds.reset_ran_share * max(1, notes.get("calls reset", 0)):
        reasons.append(f"ran {notes['ran']} of {notes['calls reset']} reset calls")
    return Verdict(
        attack=attack.name,
        kind=attack.kind,
        protocol=attack.protocol,
        target=target.name,
        held=not reasons,
        reasons=tuple(reasons),
        gap_s=round(gap, 2),
        baseline_gap_s=round(baseline, 2),
        calls=len(window),
        failed=len(failed),
        wrong=len(wrong),
        rss_growth_mib=round(growth, 1),
        recovered_s=None if recovered_s is None else round(recovered_s, 2),
        gaps_s=gaps,
        notes=notes,
        errors=tuple(sorted({c.error for c in failed})[:3]),
    )
