"""Slot references: a small, picklable name for a leased slot whose inputs are already in place.

A process that leased a slot of a node pool (through its ``NodeClient``) and
filled its inputs in place can hand another process on the same node a
:class:`SlotRef` instead of the arrays. That process (a Serve replica) maps
the same pool, checks in the pool's slot table that the slot is still held by
exactly that lease (its lock is taken, and its word is the lease's token,
``-(pid << 32 | nonce)``), and asks Triton to run on the slot's regions. The
outputs land in the slot, where the leasing process reads them in place.

Nothing here imports Ray: the Serve side is :mod:`.slot_ref_serve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.slot_table import LEASED, token_pid
from ray_triton_shm._private.shm.validate import check_shape
from ray_triton_shm.errors import InputError, SlotRefElsewhereError, SlotRefError, StaleSlotRefError

if TYPE_CHECKING:
    from ray_triton_shm.client import TritonShmClient

__all__ = ["SlotRef", "make_ref", "run_ref"]


@dataclass(frozen=True, kw_only=True)
class SlotRef:
    """Which slot of which node pool holds a request's inputs, and under which lease.

    Attributes:
        node_id: The Ray node whose shared memory holds the slot.
        model: The model the slot's pool is for.
        region: The pool's segment (its region name in Triton).
        fingerprint: The layout's model-config fingerprint (``""`` if unknown).
        slot: The slot's index in the pool.
        pid: The leasing process's pid (as it sees itself).
        token: The lease's token in the slot table (``-(pid << 32 | nonce)``).
        input_shapes: ``(name, shape)`` of every input written in the slot.
        outputs: Output names wanted; ``None``: all of them.
    """

    node_id: str
    model: str
    region: str
    fingerprint: str
    slot: int
    pid: int
    token: int
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    outputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("node_id", "model", "region"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise SlotRefError(f"SlotRef {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.fingerprint, str):
            raise SlotRefError(f"SlotRef fingerprint must be a string, got {self.fingerprint!r}")
        for name in ("slot", "pid", "token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise SlotRefError(f"SlotRef {name} must be an int, got {value!r}")
        if self.slot < 0:
            raise SlotRefError(f"SlotRef slot must be >= 0, got {self.slot}")
        if self.pid <= 0:
            raise SlotRefError(f"SlotRef pid must be > 0, got {self.pid}")
        if self.token >= LEASED or token_pid(self.token) != self.pid & 0x3FFFFF:
            raise SlotRefError(f"SlotRef token {self.token} is not a lease token of pid {self.pid}")
        names = []
        for pair in self.input_shapes:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise SlotRefError(f"SlotRef input_shapes holds (name, shape) pairs, got {pair!r}")
            name, shape = pair
            if not isinstance(shape, tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise SlotRefError(f"SlotRef shape of {name!r} must be a tuple of ints >= 0, got {shape!r}")
            names.append(name)
        if not names or len(set(names)) != len(names):
            raise SlotRefError(f"SlotRef input_shapes must name each input once, got {names}")
        if self.outputs is not None and (
            not isinstance(self.outputs, tuple) or not all(isinstance(n, str) and n for n in self.outputs)
        ):
            raise SlotRefError(f"SlotRef outputs must be a tuple of names or None, got {self.outputs!r}")

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Input shapes by name."""
        return dict(self.input_shapes)


def make_ref(lease: Lease, node_id: str, outputs: Sequence[str] | None = None) -> SlotRef | None:
    """A reference to ``lease``'s slot, or ``None`` when its slot cannot be named to another process.

    Only leases of system-memory pools shared through a slot table (a
    ``NodeClient``'s) of models without BYTES inputs have one; others send arrays.

    Raises:
        LeaseReleasedError / PoolClosedError: The lease ended or its pool was closed.
        InputError: Not every input has been placed in the slot.
    """
    lease._check_live()
    pool = lease.pool
    table = pool._table
    if table is None or pool.memory != "system":
        return None
    token = table.token(lease.slot.index)
    layout = pool.layout
    if token is None or _has_bytes_inputs(layout):
        return None
    missing = [spec.name for spec in layout.inputs if spec.name not in lease.input_shapes]
    if missing:
        raise InputError(f"lease of {layout.model!r} has no shape for inputs {missing}")
    return SlotRef(
        node_id=node_id,
        model=layout.model,
        region=pool.region_name,
        fingerprint=layout.fingerprint,
        slot=lease.slot.index,
        pid=token_pid(token),
        token=token,
        input_shapes=tuple((name, tuple(shape)) for name, shape in lease.input_shapes.items()),
        outputs=tuple(outputs) if outputs is not None else None,
    )


class _BorrowedSlot:
    """Another process's lease of a slot, as the client's request code needs it (never released here)."""

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.pool = pool
        self.layout = pool.layout
        self.region_name = pool.region_name
        self.offset = index * pool.layout.slot_bytes
        self.in_doubt = False
        self.input_nbytes: dict[str, int] = {}  # BYTES inputs' sizes: none (refused by check_ref)

    def flush(self) -> None:
        """Nothing to flush: system memory."""

    def mark_in_doubt(self) -> None:
        self.in_doubt = True

    def request_started(self, timeout_s: float | None) -> None:
        """Nothing to record: the slot table's words belong to the leasing process."""

    def request_ended(self) -> None:
        """Nothing to record (see :meth:`request_started`)."""


def _has_bytes_inputs(layout: Any) -> bool:
    """Whether a layout has BYTES inputs, whose serialised sizes a reference does not carry."""
    return any(getattr(spec, "is_bytes", False) for spec in layout.inputs)


def check_ref(pool: SlotPool, ref: SlotRef, node_id: str) -> dict[str, tuple[int, ...]]:
    """Check that ``ref`` names a slot of ``pool`` held right now by its lease; its input shapes.

    Raises:
        SlotRefElsewhereError: Another node's slot, a slot of another pool (layout), or a
            model with BYTES inputs.
        StaleSlotRefError: The slot is not (any more) held by that lease.
        InputError: The shapes do not fit the model's slot.
    """
    if ref.node_id != node_id:
        raise SlotRefElsewhereError(f"a slot reference of node {ref.node_id} reached node {node_id}")
    layout = pool.layout
    table = pool._table
    if (
        table is None
        or pool.memory != "system"
        or ref.model != layout.model
        or ref.region != pool.region_name
        or ref.fingerprint != layout.fingerprint
    ):
        raise SlotRefElsewhereError(f"the slot reference of {ref.model!r} names another pool than this one")
    if ref.slot not in pool._slots or not table.held_elsewhere_by(ref.slot, ref.token):
        raise StaleSlotRefError(
            f"slot {ref.slot} of {ref.model!r} is not held by the lease of pid {ref.pid} that the "
            "reference names (released, or leased by someone else since): nothing was run"
        )
    if _has_bytes_inputs(layout):
        raise SlotRefElsewhereError(
            f"model {ref.model!r} has BYTES inputs: slot references carry fixed-size tensors only"
        )
    shapes = ref.shapes
    unknown = [name for name in shapes if layout.input(name) is None]
    missing = [spec.name for spec in layout.inputs if spec.name not in shapes]
    if unknown or missing:
        raise InputError(f"slot reference of {ref.model!r}: unknown inputs {unknown}, missing {missing}")
    for spec in layout.inputs:
        check_shape(spec, shapes[spec.name], layout.batched, layout.batch_capacity)
    for name in ref.outputs or ():
        if layout.output(name) is None:
            raise InputError(f"model {ref.model!r} has no output {name!r}")
    return shapes


def run_ref(client: TritonShmClient, ref: SlotRef, node_id: str) -> dict[str, tuple[int, ...]]:
    """Run the model on the slot ``ref`` names (after :func:`check_ref`); the output shapes.

    The outputs are written in the slot, for the leasing process to read.

    Raises:
        SlotRefElsewhereError, StaleSlotRefError, InputError: See :func:`check_ref`.
        TritonCallError / UnavailableError: Triton refused or is gone.
    """
    pool = client.pool(ref.model)
    shapes = check_ref(pool, ref, node_id)
    borrowed: Any = _BorrowedSlot(pool, ref.slot)
    return client._call_shm(borrowed, shapes, list(ref.outputs) if ref.outputs is not None else None)
