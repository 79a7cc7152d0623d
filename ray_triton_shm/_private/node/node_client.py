"""NodeClient: zero-copy inference against the Triton of the calling process's node.

Example:
    >>> from ray_triton_shm.node import NodeClient
    >>> with NodeClient() as client:                                        # doctest: +SKIP
    ...     client.infer("add_sub", {"INPUT0": a, "INPUT1": b})

The calls a Serve replica makes besides inference (its front door's reports and
ports, attaching again) are
:class:`~ray_triton_shm._private.node.replica_calls.ReplicaCalls`; the errors of
a call cut short by a restart are in
:mod:`~ray_triton_shm._private.node.restart_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray

from ray_triton_shm._private.node import metrics
from ray_triton_shm._private.node.granted_pools import GrantedPools
from ray_triton_shm._private.node.node_config import NodeConfig, NodeInfo, split_app_args
from ray_triton_shm._private.node.node_lifecycle import attach, get_node_actor
from ray_triton_shm._private.node.node_registry import UserLock
from ray_triton_shm._private.node.replica_calls import ReplicaCalls
from ray_triton_shm._private.node.restart_errors import looks_down, registering_again, replaced_meanwhile
from ray_triton_shm._private.shm.cuda import local_gpu_count, require_device
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.triton.call_errors import region_unknown
from ray_triton_shm.client import InferResult, TritonShmClient
from ray_triton_shm.config import ClientConfig, PoolConfig
from ray_triton_shm.errors import (
    ConfigError,
    LayoutMismatchError,
    PoolClosedError,
    RayTritonShmError,
    TritonCallError,
    UnavailableError,
)

logger = logging.getLogger(__name__)


class _Unset:
    """The default of arguments whose ``None`` means something else (no deadline)."""


_UNSET = _Unset()


class NodeClient(ReplicaCalls):
    """Zero-copy inference against the Triton of the calling process's node.

    Has the inference API of :class:`~ray_triton_shm.TritonShmClient`
    (``infer``, ``ainfer``, ``infer_views``, ``lease``/``run``,
    ``infer_grpc``). If Triton restarts or the node actor is replaced, the
    next call reconnects; the call that was in flight fails with
    :class:`UnavailableError` or :class:`TritonCallError`.

    The client registers its process as a user of the node actor (which
    stops its Triton once its last user is gone, see ``idle_shutdown_s``);
    :meth:`close` unregisters it, and so does the process's death.

    Timeouts left as ``None`` come from ``config`` (its pool settings and
    ``request_timeout_s``), which reads ``RAY_TRITON_SHM_*`` variables for
    fields not given explicitly (explicit > environment > default).

    Args:
        config: What the node's Triton runs: the node actor for it is created
            if the node has none yet. ``None``: the node's only node actor.
        slots_per_model: At most this many slots of a model used by this
            process at once (``None``: no cap). Slots are shared on demand
            with every process on the node.
        lease_timeout_s: How long a request waits for a free slot.
        request_timeout_s: Deadline of one inference call.
        memory: ``"system"`` (default; outputs are numpy), ``"cuda"`` (slots in
            this process's GPU memory, outputs are cupy arrays; any model) or
            ``"auto"`` (GPU memory when this process sees a GPU and the model
            runs on GPU; else system memory). See docs/cuda.md.
        device_id: For GPU memory: this process's GPU (default cupy's current one).
        kind: What this user is (``serve``, ``data``, ``client``), shown by ``status``.
        grpc_fallback: ``ClientConfig.grpc_fallback`` of this client (``None``:
            the environment's or the default, off). The Serve app and the Ray
            Data predictor turn it on: they answer whatever Triton answers.

    Raises:
        ConfigError: Unknown ``memory``.
        CudaUnavailableError / NoGpuError: ``memory="cuda"`` without cupy or a GPU.
    """

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        slots_per_model: int | None = None,
        lease_timeout_s: float | None = None,
        request_timeout_s: float | _Unset | None = _UNSET,
        memory: str = "system",
        device_id: int | None = None,
        kind: str = "client",
        grpc_fallback: bool | None = None,
    ) -> None:
        if memory not in ("system", "cuda", "auto"):
            raise ConfigError(f"NodeClient memory must be system, cuda or auto, got {memory!r}")
        # An explicit "cuda" gets GPU memory for any model; "auto" only for models that run on GPU.
        self._force_cuda = memory == "cuda"
        if memory == "cuda":
            require_device(device_id)
        elif memory == "auto":
            memory = "cuda" if local_gpu_count() > 0 else "system"
        self._memory = memory
        self._device_id = device_id
        self._kind = kind
        self._grpc_fallback = grpc_fallback
        if slots_per_model is not None and slots_per_model < 1:
            raise ConfigError(f"NodeClient slots_per_model must be >= 1 or None, got {slots_per_model!r}")
        self._config = config
        self._slots = slots_per_model
        self._lease_timeout = lease_timeout_s
        if isinstance(request_timeout_s, _Unset) and config is not None:
            request_timeout_s = config.request_timeout_s
        self._request_timeout = request_timeout_s  # still unset: ClientConfig's (environment or default)
        self._user_id = uuid.uuid4().hex
        self._actor: ray.actor.ActorHandle | None = None
        self._lock = threading.Lock()
        self._inner: TritonShmClient | None = None
        self._observer: metrics.RayMetricsObserver | None = None
        self.info: NodeInfo | None = None
        self._closed = False
        self._recheck = False  # a call failed as if Triton were down: look for a restart before the next
        # Held while this process uses the node: the actor counts it as a user for as long.
        self._user_lock = UserLock()
        try:
            self._connect()
        except BaseException:
            self._user_lock.close()
            raise

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None = None, **options: Any) -> NodeClient:
        """A client of the node's Triton configured by the Serve app's ``args`` (see ``serve.app``).

        The same mapping as ``args`` of ``ray_triton_shm.serve:app`` in a Serve
        config file (``model_repository``, ``pools``, ``default_pool``,
        ``server``, node settings, ``slots_per_model``, ``memory``): a
        deployment, task or actor given the same args shares the app's node
        Triton and slot pools.

        Args:
            args: The app's args.
            **options: Other :class:`NodeClient` arguments (``lease_timeout_s``,
                ``request_timeout_s``, ``device_id``, ``kind``).

        Raises:
            ConfigError: Invalid args.
            UnavailableError: The node's Triton cannot be started or reached.
        """
        config, client_options = split_app_args(args)
        return cls(config, **{**client_options, **options})

    def _pool_config(self, base: PoolConfig) -> PoolConfig:
        fields: dict[str, Any] = {"memory": self._memory, "device_id": self._device_id}
        if self._lease_timeout is not None:
            fields["lease_timeout_s"] = self._lease_timeout
        return dataclasses.replace(base, **fields)

    def _connect(self) -> TritonShmClient:
        actor, info = attach(self._config, self._user_id, os.getpid(), self._kind, lock=self._user_lock)
        self._actor = actor
        config = self._config
        extra: dict[str, Any] = (
            {} if isinstance(self._request_timeout, _Unset) else {"request_timeout_s": self._request_timeout}
        )
        if self._grpc_fallback is not None:
            extra["grpc_fallback"] = self._grpc_fallback
        client_config = ClientConfig(
            url=info.grpc_url,
            http_url=info.http_url,
            pools={m: self._pool_config(p) for m, p in (config.pools if config else {}).items()},
            default_pool=self._pool_config(config.default_pool if config else PoolConfig()),
            **extra,
        )
        observer = metrics.RayMetricsObserver(actor)
        source = GrantedPools(actor, self._slots, info, self._force_cuda)
        inner = TritonShmClient(client_config, pool_source=source, observer=observer)
        old, self._inner, self.info = self._inner, inner, info
        old_observer, self._observer = self._observer, observer
        if old is not None:
            old.close()
        if old_observer is not None:
            old_observer.close()
        return inner

    def _reconnect_if_changed(self) -> bool:
        """After a failure: reconnect if Triton or the actor changed. Returns whether it did."""
        with self._lock:
            if self._closed:  # a request that failed because close() ran meanwhile: stay closed
                return False
            try:
                actor = get_node_actor(self._config)
                info: NodeInfo = ray.get(actor.info.remote(), timeout=60)
            except (RayTritonShmError, ray.exceptions.RayError):
                info = None
            if info is None:
                # The actor is gone (or going): attach to its successor, if one can start.
                try:
                    self._connect()
                except (RayTritonShmError, ray.exceptions.RayError):
                    return False
                return True
            current = self.info
            if current and (info.instance_id, info.epoch, info.grpc_url) == (
                current.instance_id,
                current.epoch,
                current.grpc_url,
            ):
                return False
            logger.info(
                "node Triton changed (epoch %s -> %s); reconnecting", current and current.epoch, info.epoch
            )
            self._connect()
            return True

    def _before_call(self) -> None:
        # The node restarts Triton without blocking ``info``: a failure during the restart saw the
        # old epoch, so look again once before the next call (one actor round trip, only then).
        if self._recheck:
            self._recheck = False
            self._reconnect_if_changed()

    def _after_failure(self, error: TritonCallError) -> None:
        if not self._reconnect_if_changed() and looks_down(error):
            self._recheck = True

    @property
    def client(self) -> TritonShmClient:
        """The underlying client for the current connection.

        Raises:
            PoolClosedError: The NodeClient is closed.
        """
        if self._inner is None:
            raise PoolClosedError("NodeClient is closed")
        return self._inner

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        copy: bool = True,
    ) -> InferResult:
        """See :meth:`TritonShmClient.infer`; reconnects for the next call after a Triton restart.

        ``timeout`` is how long to wait for a free slot (default: the pool's
        ``lease_timeout_s``); the call's own deadline is ``request_timeout_s``.
        A request that reaches a restarted Triton before the node registered its
        regions there again raises :class:`UnavailableError` (try again).

        Raises:
            InputError, PoolTimeoutError, TritonCallError, UnavailableError.
        """
        self._before_call()
        with self._call_errors():
            try:
                return self.client.infer(model, inputs, outputs=outputs, timeout=timeout, copy=copy)
            except LayoutMismatchError as e:  # the model was reloaded: once more, on the new layout
                self._layout_changed(e)
                return self.client.infer(model, inputs, outputs=outputs, timeout=timeout, copy=copy)

    async def ainfer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
        copy: bool = True,
    ) -> InferResult:
        """See :meth:`TritonShmClient.ainfer` (and :meth:`infer` for ``timeout``)."""
        if self._recheck:
            await asyncio.to_thread(self._before_call)
        try:
            try:
                return await self.client.ainfer(model, inputs, outputs=outputs, timeout=timeout, copy=copy)
            except LayoutMismatchError as e:  # the model was reloaded: once more, on the new layout
                await asyncio.to_thread(self._layout_changed, e)
                return await self.client.ainfer(model, inputs, outputs=outputs, timeout=timeout, copy=copy)
        except (UnavailableError, TritonCallError) as e:
            await asyncio.to_thread(self._after_failure, e)
            if region_unknown(e):
                raise registering_again(e, self.info) from e
            raise
        except PoolClosedError as e:
            if self._closed:
                raise
            raise replaced_meanwhile(e, self.info) from e

    def _layout_changed(self, error: LayoutMismatchError) -> None:
        """After a :class:`LayoutMismatchError`: make sure the node retired the stale pool.

        A pool the node retired itself (a load through it) says so in its slot
        table (``server_fingerprint`` empty); a mismatch found by asking Triton
        (the model was reloaded behind the node's back) is reported, so the node
        retires the pool and the next call takes a grant of the new layout.
        """
        logger.info("%s; retrying once on the new layout", error)
        actor = self._actor
        if error.server_fingerprint and actor is not None:
            ray.get(actor.layout_changed.remote(error.model), timeout=60)

    def model_changed(self, model: str) -> None:
        """Tell the node that ``model`` was loaded, reloaded or unloaded on its Triton by someone else.

        The node reads the model's configuration again and retires its pools
        of another layout (see the node actor's ``layout_changed``); the next
        call takes a grant of the new one.

        Raises:
            UnavailableError: Triton is restarting or does not answer.
        """
        actor = self._actor
        if actor is not None:
            ray.get(actor.layout_changed.remote(model), timeout=60)

    def infer_grpc(self, model: str, inputs: Mapping[str, Any]) -> InferResult:
        """See :meth:`TritonShmClient.infer_grpc` (plain gRPC, for comparison)."""
        return self.client.infer_grpc(model, inputs)

    def infer_views(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        timeout: float | None = None,
    ):
        """See :meth:`TritonShmClient.infer_views` (a context manager yielding read-only output views)."""
        return self.client.infer_views(model, inputs, outputs=outputs, timeout=timeout)

    def lease(self, model: str, timeout: float | None = None) -> Lease:
        """Lease a slot of ``model`` to fill in place (``lease.input(name, shape)``), then :meth:`run`.

        Use it in a ``with`` block: the slot goes back to the node's pool when it ends.

        Raises:
            PoolTimeoutError: No slot became free within ``timeout`` (default: the pool's).
            PoolClosedError: The client is closed.
        """
        self._before_call()
        return self.client.lease(model, timeout)

    async def alease(self, model: str, timeout: float | None = None) -> Lease:
        """:meth:`lease` for asyncio code; the event loop is not blocked while waiting for a slot."""
        if self._recheck:
            await asyncio.to_thread(self._before_call)
        return await self.client.alease(model, timeout)

    def run(self, lease: Lease, outputs: Sequence[str] | None = None) -> dict[str, Any]:
        """Run the model on the inputs already in ``lease``'s slot; read-only output views.

        See :meth:`TritonShmClient.run`. The views are valid until the lease ends.

        Raises:
            InputError, LeaseReleasedError, OutputTooLargeError, TritonCallError, UnavailableError.
        """
        with self._call_errors():
            return self.client.run(lease, outputs)

    @contextlib.contextmanager
    def _call_errors(self) -> Iterator[None]:
        """A call's failures as the node's users see them: a Triton that forgot our regions is
        registering them again, a pool closed under the call was replaced (both: try again)."""
        try:
            yield
        except (UnavailableError, TritonCallError) as e:
            self._after_failure(e)
            if region_unknown(e):
                raise registering_again(e, self.info) from e
            raise
        except PoolClosedError as e:
            if self._closed:
                raise
            raise replaced_meanwhile(e, self.info) from e

    def begin_run(self, lease: Lease, outputs: Sequence[str] | None = None) -> Any:
        """:meth:`run`'s first half (see ``TritonShmClient.begin_run``)."""
        return self.client.begin_run(lease, outputs)

    def finish_run(self, request: Any, code: int, body: bytes, retry: bool) -> dict[str, Any] | None:
        """:meth:`run`'s second half (see ``TritonShmClient.finish_run``).

        Raises:
            As :meth:`run`.
        """
        with self._call_errors():
            return self.client.finish_run(request, code, body, retry)

    async def arun(self, lease: Lease, outputs: Sequence[str] | None = None) -> dict[str, Any]:
        """:meth:`run` for asyncio code (in a worker thread)."""
        return await asyncio.to_thread(self.run, lease, outputs)

    def model_config(self, model: str) -> dict[str, Any]:
        """The model's configuration as Triton reports it."""
        return self.client._grpc.get_model_config(model, as_json=True)["config"]

    def model_metadata(self, model: str) -> dict[str, Any]:
        """The model's KServe v2 metadata."""
        return self.client._grpc.get_model_metadata(model, as_json=True)

    def flush_reports(self) -> None:
        """Send the traffic counted so far to the node actor now (fire-and-forget).

        For short-lived workers (Ray Data actors are killed when their job ends,
        without a ``close``) whose whole run can fit in one reporting interval.
        """
        observer = self._observer
        if observer is not None:
            observer.flush()

    def close(self) -> None:
        """Let go of the node's pools and unregister as a user of its Triton. Idempotent."""
        with self._lock:
            self._closed = True
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.close()
        actor, self._actor = self._actor, None
        if actor is not None:
            try:
                ray.get(actor.detach.remote(self._user_id), timeout=10)
            except ray.exceptions.RayError as e:  # gone already: nothing to unregister from
                logger.debug("detach from the node actor failed: %s", e)
        self._user_lock.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
