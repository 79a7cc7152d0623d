"""The ``serve-slotref`` rows: slot references through our Serve deployment's handle.

Each caller (the bench driver, on the replica's node) holds a slot of the
node's pool whose input a producer wrote in place once, as ``ours-inplace``
does; a timed call sends only a :class:`~ray_triton_shm._private.serve.slot_ref.SlotRef`
through the ``DeploymentHandle`` (the replica runs Triton on that slot) and
reads the output in the slot. So the row is ``ours-inplace`` plus a handle
round trip, beside ``serve-grpc`` (arrays through the handle, gRPC behind).

Each cell also measures the floor of that round trip: the same handle
calling a method that runs nothing (``whereami``), one call at a time. No
slot-reference call can be faster than ``ours-inplace`` plus that floor.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.bench.core_methods import Caller, Cell, OutputMismatch, check_equal
from ray_triton_shm.node import NodeClient
from ray_triton_shm.serve import SlotRefCaller


@dataclass(frozen=True)
class SlotRefTarget:
    """Our deployment's handle and the node config its replicas use (the callers lease from it)."""

    handle: Any
    node_config: Any


def slotref_cell(method: str, target: SlotRefTarget, inputs: list[np.ndarray], model: str) -> Cell:
    """Callers sending slot references of ``model`` (an identity) through ``target``'s handle.

    Raises:
        OutputMismatch: A call went another way than a slot reference.
    """
    client = NodeClient(target.node_config, kind="client")
    cell = Cell([], [client.close], {"slot_ref"})
    caller = SlotRefCaller(target.handle, client=client)
    cell.closers.append(caller.close)

    def make(x: np.ndarray) -> Caller:
        lease = caller.lease(model)
        cell.closers.append(lease.release)
        if not lease.in_slot:
            raise OutputMismatch(f"{method}: no slot of {model!r} on this node to reference")
        lease.input("INPUT0", x.shape)[...] = x
        slot = lease.lease.slot  # not its arrays: the cell must keep no view once it is closed

        def call(check: bool) -> object:
            if check:  # whatever a previous call left in the output region cannot pass
                slot.arrays["OUTPUT0"][: x.size] = np.nan
            out = caller.run(lease)
            if check:
                if out.path != "slot_ref":
                    raise OutputMismatch(f"{method}: went as {out.path}, not as a slot reference")
                check_equal(method, out["OUTPUT0"], x)
            return out["OUTPUT0"].shape

        return call

    cell.callers = [make(x) for x in inputs]
    cell.extra["handle_floor_p50_ms"] = handle_floor_ms(caller.ref_handle)
    return cell


def handle_floor_ms(handle: Any, calls: int = 40, warmup: int = 10) -> float:
    """Median milliseconds of a round trip through ``handle`` to a method that runs nothing."""
    for _ in range(warmup):
        handle.whereami.remote().result()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        handle.whereami.remote().result()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3
