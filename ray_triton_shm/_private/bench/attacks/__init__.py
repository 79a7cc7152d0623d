"""Bounded attacks on a KServe v2 server's ports, legitimate callers meanwhile, and a verdict each.

Classes (:data:`~.catalog.CLASSES`): slow or stalled clients (:mod:`.stall`),
memory sized by the client (:mod:`.memory`), connections (:mod:`.conns`),
reset calls and frame floods (:mod:`.floods`), HTTP/1.1 protocol faults
(:mod:`.faults`). Legitimate callers: :mod:`.legit`; one attack judged:
:mod:`.judge`; the table against Triton's own ports: :mod:`.table`.
Attack traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

from ray_triton_shm._private.bench.attacks import conns, faults, floods, memory, stall
from ray_triton_shm._private.bench.attacks.catalog import CLASSES, Attack

ATTACKS: tuple[Attack, ...] = stall.ATTACKS + memory.ATTACKS + conns.ATTACKS + floods.ATTACKS + faults.ATTACKS
BY_NAME = {a.name: a for a in ATTACKS}

__all__ = ["ATTACKS", "BY_NAME", "CLASSES", "Attack"]
