"""Slot references through Serve handles: the replica's handle methods and the caller's helper.

The caller on the replica's node leases a slot through its own ``NodeClient``,
fills the inputs in place and sends only a :class:`~.slot_ref.SlotRef` through
the ``DeploymentHandle``; the replica runs the model on that slot and the
caller reads the outputs in place. From a node without the pool (or with no
lease) the arrays travel instead, through the handle's ``infer``.

Example:
    >>> caller = SlotRefCaller(serve.get_app_handle("triton"))          # doctest: +SKIP
    >>> with caller.lease("multi_io") as lease:                         # doctest: +SKIP
    ...     lease.input("INPUT0", (1, 3, 224, 224))[:] = image
    ...     lease.input("INPUT1", (1, 10))[:] = 1
    ...     out = caller.run(lease)   # out["OUTPUT0"]: read in the slot (out.path == "slot_ref")
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray.serve.handle import DeploymentHandle

from ray_triton_shm._private.node.node_config import actor_name, split_app_args
from ray_triton_shm._private.node.node_lifecycle import node_actor_names
from ray_triton_shm._private.serve.slot_ref import SlotRef, make_ref, run_ref
from ray_triton_shm._private.shm.layout import TRITON_TO_NUMPY
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.validate import check_shape
from ray_triton_shm._private.triton.call_errors import IN_DOUBT_STATUSES
from ray_triton_shm.client import InferResult
from ray_triton_shm.errors import (
    InputError,
    LeaseReleasedError,
    RayTritonShmError,
    SlotRefElsewhereError,
    TritonCallError,
    UnavailableError,
)
from ray_triton_shm.node import NodeClient

__all__ = ["SlotRefCaller", "SlotRefLease", "SlotRefMixin"]

logger = logging.getLogger(__name__)


class SlotRefMixin:
    """Handle methods of a replica holding a ``NodeClient`` as ``self._client`` (see ``TritonDeployment``)."""

    _client: Any

    async def infer_ref(self, ref: SlotRef) -> dict[str, Any]:
        """Run the model on the slot ``ref`` names; the outputs stay in the slot.

        Returns:
            ``{"shapes": {output: shape}, "node_id": ..., "pid": ...}`` (this replica's node and pid).

        Raises:
            SlotRefElsewhereError: ``ref`` is another node's (or another pool's): send arrays.
            StaleSlotRefError: The slot is no longer held by that lease; nothing ran.
            InputError, TritonCallError, UnavailableError.
        """
        if not isinstance(ref, SlotRef):
            raise InputError(f"infer_ref takes a SlotRef, got {type(ref).__name__}")
        node_id = getattr(self, "_slot_ref_node_id", None)
        if node_id is None:  # an actor never changes node
            node_id = self._slot_ref_node_id = ray.get_runtime_context().get_node_id()
        shapes = await asyncio.to_thread(self._run_ref, ref, node_id)
        return {"shapes": shapes, "node_id": node_id, "pid": os.getpid()}

    def _run_ref(self, ref: SlotRef, node_id: str) -> dict[str, tuple[int, ...]]:
        client = self._client
        try:
            return run_ref(client.client, ref, node_id)
        except (UnavailableError, TritonCallError) as e:
            client._after_failure(e)
            raise

    async def input_specs(self, model: str) -> dict[str, str]:
        """``model``'s inputs and their numpy dtypes (for callers that fill arrays rather than a slot).

        Raises:
            TritonCallError: Triton does not know the model.
        """
        signature = await asyncio.to_thread(self._client.client.signature, model)
        # BYTES (and any type numpy has no fixed size for) are object arrays, as for infer_grpc.
        return {
            spec.name: TRITON_TO_NUMPY.get(spec.datatype, np.dtype(object)).str for spec in signature.inputs
        }


class SlotRefLease:
    """Inputs to fill in place for one call: a slot of the node's pool, or arrays when there is none.

    Use it in a ``with`` block; the slot goes back to its pool at the end.
    Outputs returned by :meth:`SlotRefCaller.run` are valid until then.
    """

    def __init__(self, model: str, lease: Lease | None, dtypes: Mapping[str, str] | None = None) -> None:
        self.model = model
        self.lease = lease
        self._dtypes = dict(dtypes or {})
        self._arrays: dict[str, np.ndarray] = {}
        self._released = False
        self.served_by: dict[str, Any] | None = None
        """Node id and pid of the replica that ran the last slot-reference call."""

    @property
    def in_slot(self) -> bool:
        """Whether the inputs live in a shared slot (so a reference can be sent)."""
        return self.lease is not None

    def input(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A writable array for input ``name`` with ``shape`` (a view of the slot when there is one).

        Raises:
            InputError: Unknown input, or a shape that does not fit.
            LeaseReleasedError: The lease has ended.
        """
        if self._released:
            raise LeaseReleasedError("this lease was released")
        if self.lease is not None:
            return self.lease.input(name, shape)
        dtype = self._dtypes.get(name)
        if dtype is None:
            raise InputError(f"model {self.model!r} has inputs {sorted(self._dtypes)}; unknown: {name!r}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InputError(f"{name}: shape {list(shape)} has a negative dimension")
        array = self._arrays[name] = np.empty(shape, np.dtype(dtype))
        return array

    def inputs(self) -> dict[str, np.ndarray]:
        """The inputs placed so far, by name (views of the slot, or the arrays)."""
        if self.lease is None:
            return dict(self._arrays)
        lease = self.lease
        spec_of = lease.layout.input
        out = {}
        for name, shape in lease.input_shapes.items():
            spec = spec_of(name)
            count = check_shape(spec, shape, lease.layout.batched, lease.layout.batch_capacity)
            out[name] = lease.slot.arrays[name][:count].reshape(shape)
        return out

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        self._released = True
        self._arrays = {}
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> SlotRefLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class SlotRefCaller:
    """Calls a ``TritonDeployment`` handle with slot references when it can, arrays when not.

    A caller on a node with the deployment's node actor leases slots through
    its own ``NodeClient`` (``client``, or one made from the app's ``args``, or
    the node's only node actor) and sends :class:`SlotRef` s; elsewhere, or when
    the replica that got the call runs on another node, the inputs travel as
    arrays through the handle's ``infer``. Either way :meth:`run` returns the
    outputs by name (``.path``: ``"slot_ref"`` read in the slot, ``"handle"``
    arrays that came back).

    The handle prefers a replica on the caller's node (Serve's local-node
    routing, ``_prefer_local_routing``): a ref call goes to another node only
    when no local replica can take it, and then falls back to arrays.

    Args:
        handle: The deployment's handle (``serve.get_app_handle(name)``).
        client: A ``NodeClient`` of the app's node actor (not closed by this caller).
        args: The app's args, to make that client (when ``client`` is None).
        prefer_local: Route to a replica on this node when there is one.

    Raises:
        RayTritonShmError: Invalid ``args``.
    """

    def __init__(
        self,
        handle: Any,
        *,
        client: Any = None,
        args: Mapping[str, Any] | None = None,
        prefer_local: bool = True,
    ) -> None:
        self._handle = _prefer_local(handle) if prefer_local else handle
        # References and their answers are a few hundred bytes: sent over Serve's gRPC transport
        # to the replica rather than through the object store (about 1 ms less per call).
        self._ref_handle = _by_value(self._handle)
        self._client = client
        self._own_client = False
        self._args = args
        self._looked = client is not None
        self._dtypes: dict[str, dict[str, str]] = {}
        self.node_id = ray.get_runtime_context().get_node_id()

    @property
    def handle(self) -> Any:
        """The handle the calls go through."""
        return self._handle

    @property
    def ref_handle(self) -> Any:
        """The handle slot-reference calls go through (the same deployment, answers by value)."""
        return self._ref_handle

    def node_client(self) -> Any:
        """This node's ``NodeClient`` for the app, or ``None`` when the node has no node actor for it."""
        if not self._looked:
            self._looked = True
            self._client = _local_client(self._args)
            self._own_client = self._client is not None
        return self._client

    def lease(self, model: str, timeout: float | None = None) -> SlotRefLease:
        """Inputs of ``model`` to fill in place: a leased slot of this node's pool, else arrays.

        Raises:
            PoolTimeoutError: No slot became free within ``timeout``.
            TritonCallError: The model is unknown.
        """
        client = self.node_client()
        if client is not None:
            lease = client.lease(model, timeout)
            if lease.pool._table is not None and lease.pool.memory == "system":
                return SlotRefLease(model, lease)
            lease.release()  # a pool no other process can see: arrays it is
        return SlotRefLease(model, None, self._input_dtypes(model))

    async def alease(self, model: str, timeout: float | None = None) -> SlotRefLease:
        """:meth:`lease` for asyncio code."""
        return await asyncio.to_thread(self.lease, model, timeout)

    def _input_dtypes(self, model: str) -> dict[str, str]:
        dtypes = self._dtypes.get(model)
        if dtypes is None:
            dtypes = self._dtypes[model] = self._handle.input_specs.remote(model).result()
        return dtypes

    def run(self, lease: SlotRefLease, outputs: Sequence[str] | None = None) -> InferResult:
        """Run the model on ``lease``'s inputs: a slot reference if it can, else arrays.

        Raises:
            StaleSlotRefError: The lease ended under the call.
            InputError, PoolTimeoutError, TritonCallError, UnavailableError: As for the handle's ``infer``.
        """
        ref = self._ref(lease, outputs)
        if ref is not None:
            try:
                answer = self._ref_handle.infer_ref.remote(ref).result()
            except SlotRefElsewhereError:
                logger.debug("the replica is elsewhere; sending %s's inputs as arrays", lease.model)
            except BaseException as e:
                _after_ref_failure(lease, e)
                raise
            else:
                return self._outputs(lease, answer)
        return self._arrays_result(self._handle.infer.remote(lease.model, lease.inputs()).result(), outputs)

    async def arun(self, lease: SlotRefLease, outputs: Sequence[str] | None = None) -> InferResult:
        """:meth:`run` for asyncio code (``await`` on the handle, the event loop free)."""
        ref = self._ref(lease, outputs)
        if ref is not None:
            try:
                answer = await self._ref_handle.infer_ref.remote(ref)
            except SlotRefElsewhereError:
                logger.debug("the replica is elsewhere; sending %s's inputs as arrays", lease.model)
            except BaseException as e:
                _after_ref_failure(lease, e)
                raise
            else:
                return self._outputs(lease, answer)
        return self._arrays_result(await self._handle.infer.remote(lease.model, lease.inputs()), outputs)

    def infer(
        self, model: str, inputs: Mapping[str, Any], outputs: Sequence[str] | None = None
    ) -> InferResult:
        """Run ``model`` on arrays the caller already has: copied into a slot and referenced, else sent.

        Raises:
            The errors of :meth:`run`.
        """
        with self.lease(model) as lease:
            for name, value in inputs.items():
                lease.input(name, np.shape(value))[...] = value
            result = self.run(lease, outputs)
            return InferResult({k: np.array(v) for k, v in result.items()}, result.path)

    def _ref(self, lease: SlotRefLease, outputs: Sequence[str] | None) -> SlotRef | None:
        if lease._released:
            raise LeaseReleasedError("this lease was released")
        return make_ref(lease.lease, self.node_id, outputs) if lease.lease is not None else None

    @staticmethod
    def _outputs(lease: SlotRefLease, answer: Mapping[str, Any]) -> InferResult:
        lease.served_by = {"node_id": answer["node_id"], "pid": answer["pid"]}
        slot = lease.lease
        assert slot is not None  # only ref calls get here
        return InferResult(
            {name: slot.output(name, shape) for name, shape in answer["shapes"].items()}, "slot_ref"
        )

    @staticmethod
    def _arrays_result(outputs: Mapping[str, Any], wanted: Sequence[str] | None) -> InferResult:
        if wanted is not None:
            outputs = {name: outputs[name] for name in wanted}
        return InferResult(dict(outputs), "handle")

    def close(self) -> None:
        """Close the ``NodeClient`` this caller made (not one it was given). Idempotent."""
        client, self._client = self._client, None
        if client is not None and self._own_client:
            client.close()

    def __enter__(self) -> SlotRefCaller:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _after_ref_failure(lease: SlotRefLease, error: BaseException) -> None:
    """A ref call that failed in a way where Triton may still write the slot: hold the slot back."""
    slot = lease.lease
    if slot is None:
        return
    cause = error
    while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, BaseException):
        cause = cause.cause
    if isinstance(cause, TritonCallError) and cause.status not in IN_DOUBT_STATUSES:
        return  # Triton answered: nothing of this request is running
    if isinstance(cause, RayTritonShmError) and not isinstance(cause, TritonCallError):
        return  # refused before anything was sent (stale ref, bad shapes)
    slot.mark_in_doubt()


def _prefer_local(handle: Any) -> Any:
    """A handle of the same deployment that prefers replicas on this node (Serve's local-node routing).

    Ray 2.x sets it when a handle is initialised (``_init(_prefer_local_routing=True)``, private);
    an initialised handle cannot change it, so a fresh one is made (not through
    ``serve.get_deployment_handle``, which hands out one cached handle). Without that API the
    handle is used as given.
    """
    options = getattr(handle, "init_options", None)
    if options is not None and getattr(options, "_prefer_local_routing", False):
        return handle
    try:
        fresh = DeploymentHandle(handle.deployment_name, handle.app_name)
        fresh._init(_prefer_local_routing=True)
        return fresh
    except (AttributeError, RuntimeError, TypeError) as e:
        logger.warning("cannot make the handle prefer local replicas (%s); using it as given", e)
        return handle


def _by_value(handle: Any) -> Any:
    """``handle`` sending requests and answers by value (Serve's private ``_by_reference=False``)."""
    try:
        return handle.options(_by_reference=False)
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        logger.info("slot references go through the object store (%s)", e)
        return handle


def _local_client(args: Mapping[str, Any] | None) -> Any:
    """A ``NodeClient`` of this node's node actor for ``args``, or None if the node runs none."""
    node_id = ray.get_runtime_context().get_node_id()
    try:
        if args is None:
            return NodeClient(kind="client")
        config, options = split_app_args(args)
        if actor_name(node_id, config) not in node_actor_names(node_id):
            return None  # no replica of this app here: do not start a Triton for a caller
        return NodeClient(config, **{**options, "memory": "system", "kind": "client"})
    except RayTritonShmError as e:
        logger.info("no node actor to lease slots from on this node (%s); sending arrays", e)
        return None
