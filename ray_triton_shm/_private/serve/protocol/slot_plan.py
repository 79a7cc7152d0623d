"""Whether a KServe v2 inference request runs in one leased slot, and running it there.

Transport-neutral: the HTTP and gRPC listeners of the front door and the Serve
ingress ask :func:`shm_plan` before they lease a slot for a request's tensors,
and :func:`run_leased` runs the slot with the fallbacks ``infer`` has.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.core.slot_runs import chunks
from ray_triton_shm._private.serve.protocol import kserve
from ray_triton_shm._private.shm.validate import check_inputs
from ray_triton_shm.errors import LayoutMismatchError, OutputTooLargeError, RayTritonShmError


def fast_path_lengths(headers: Any) -> tuple[int, int] | None:
    """(header length, body length) when the body can go straight into a slot, else ``None``.

    Args:
        headers: The request's headers (``get`` by lower-case name).
    """
    encoding = (headers.get("content-encoding") or "identity").strip().lower()
    if encoding != "identity":  # the general path refuses a bad encoding before a bad header length
        return None
    header_length = kserve.parse_header_length(headers.get(kserve.HEADER_LENGTH))
    content_length = headers.get("content-length")
    if header_length is None or content_length is None:
        return None
    text = content_length.strip()
    if not (text.isdigit() and text.isascii()):
        return None
    return header_length, int(text)


BUSY_STALL_S = 0.1
"""Longest a leased slot waits on a client while other calls wait for a slot of its pool."""


def slot_stall(lease: Any, stall_s: float, busy_stall_s: float) -> float:
    """How long ``lease``'s slot may wait on a client now: ``busy_stall_s`` while other calls of
    this process wait for a slot of its pool, else ``stall_s``.

    So many slow clients, more than the slots, cannot keep a pool's slots for ``stall_s`` each
    while prompt callers queue behind them.
    """
    return min(stall_s, busy_stall_s) if lease.pool.waiting else stall_s


def pool_at_hand(client: Any, model: str) -> bool:
    """Whether ``client`` has a live pool of ``model`` and nothing to look up first (no I/O needed)."""
    try:
        pool = None if getattr(client, "_recheck", False) else client.client._pools.get(model)
    except RayTritonShmError:
        return False
    return pool is not None and not pool.retired


def shm_plan(client: Any, model: str, inputs: Mapping[str, Any], outputs: Sequence[str] | None) -> bool:
    """Whether ``client.ainfer`` would run ``inputs`` through one system-memory slot of ``model``.

    Any doubt (no layout, inputs the model refuses, several slots, a payload
    small enough for gRPC, GPU memory) answers ``False``: the general path then
    runs and gives the same answer or error as it always did.
    """
    if getattr(client, "_recheck", False):  # as ainfer does first: Triton may have restarted
        client._before_call()
    inner = client.client
    layout = inner._layout_or_none(model)
    if layout is None:
        return False
    # BYTES tensors (serialised in their regions where slots hold them) take the general path.
    if any(spec.datatype == "BYTES" for spec in (*layout.inputs, *layout.outputs)):
        return False
    try:
        pool = inner.pool(model)
        checked = check_inputs(layout, inputs)
        inner._wanted_outputs(layout, outputs)
    except RayTritonShmError:
        return False
    if pool.memory != "system" or checked.on_device or len(chunks(layout, checked.batch)) != 1:
        return False
    threshold = inner.config.pool_for(model).shm_threshold(over_http=inner._http is not None, cuda=False)
    return checked.nbytes >= threshold


def run_leased(client: Any, model: str, lease: Any, outputs: Sequence[str] | None) -> Mapping[str, Any]:
    """``client.run`` on the inputs already in ``lease``'s slot, with what ``infer`` handles itself.

    A reloaded model (``LayoutMismatchError``) or an output over its slot
    (``OutputTooLargeError``): the inputs are copied out of the slot, the slot
    given back, and ``client.infer`` runs them its own way.

    Raises:
        As ``client.run`` and ``client.infer``.
    """
    try:
        return client.run(lease, outputs)
    except (LayoutMismatchError, OutputTooLargeError) as e:
        shapes = list(lease.input_shapes.items())
        inputs = {name: np.array(lease.input(name, shape)) for name, shape in shapes}
        lease.release()
        if isinstance(e, LayoutMismatchError):
            client._layout_changed(e)
        return client.infer(model, inputs, outputs=outputs)


@dataclass(frozen=True, kw_only=True)
class SlotPlan:
    """How a request of one description runs in a slot: what :func:`shm_plan` said yes to.

    Attributes:
        request: The request's description, parsed (shared by every call of that
            description: read, never changed).
        placeholders: Each input's placeholder (its shape and dtype, no memory).
        outputs: The outputs asked for (``None``: all).
        pool: The model's pool the plan was made for.
        inner: The node client's connection the plan was made on.
    """

    request: Any
    placeholders: Mapping[str, np.ndarray]
    outputs: tuple[str, ...] | None
    pool: Any
    inner: Any


class PlanCache:
    """The slot plans of recent request descriptions, by their bytes.

    A client that calls again with a description it sent before (the same
    model, inputs, shapes and outputs: every call of a serving loop) skips
    parsing and planning. A plan is used only while the node client's
    connection and the model's pool are the ones it was made with, and not
    after a failure that may mean Triton restarted; else it is dropped and made
    again. Refusals are not kept: a description planned ``False`` is planned
    again each time.

    Args:
        max_plans: Plans kept at most (the oldest goes first).
        max_key_bytes: Longest description kept (longer ones are planned each time).

    Raises:
        ValueError: A bound is not a positive integer.
    """

    def __init__(self, max_plans: int = 64, max_key_bytes: int = 4096) -> None:
        for name, value in (("max_plans", max_plans), ("max_key_bytes", max_key_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self._max_plans = max_plans
        self._max_key_bytes = max_key_bytes
        self._plans: dict[bytes, SlotPlan] = {}
        self._lock = threading.Lock()  # around insertion and eviction; lookups take a plain dict read

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, client: Any, key: bytes) -> SlotPlan | None:
        """The plan of description ``key``, if one is kept and still holds for ``client``."""
        plan = self._plans.get(key)
        if plan is None:
            return None
        try:
            current = not getattr(client, "_recheck", False) and client.client is plan.inner
        except RayTritonShmError:  # the node client is closed
            current = False
        pool = plan.pool
        if current and not pool.retired and plan.inner._pools.get(plan.request.model_name) is pool:
            return plan
        with self._lock:
            if self._plans.get(key) is plan:
                del self._plans[key]
        return None

    def put(self, key: bytes, plan: SlotPlan) -> None:
        """Keep ``plan`` for description ``key`` (not when ``key`` is longer than the bound)."""
        if len(key) > self._max_key_bytes:
            return
        with self._lock:
            if key not in self._plans and len(self._plans) >= self._max_plans:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
