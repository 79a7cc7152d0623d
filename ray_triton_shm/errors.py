"""Exceptions raised by ray_triton_shm.

Every error derives from :class:`RayTritonShmError`, and every constructor
passes all of its arguments to ``super().__init__`` so that errors survive a
pickle round trip across Ray actor and task boundaries.

Example:
    >>> from ray_triton_shm.errors import PoolTimeoutError, RayTritonShmError
    >>> try:
    ...     raise PoolTimeoutError("identity", 0.5)
    ... except RayTritonShmError as err:
    ...     print(type(err).__name__)
    PoolTimeoutError
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "DeviceMappingError",
    "FrontDoorError",
    "InputError",
    "LayoutError",
    "LayoutMismatchError",
    "LeaseReleasedError",
    "ModelControlRefusedError",
    "NoGpuError",
    "OutputTooLargeError",
    "OverloadedError",
    "PoolClosedError",
    "PoolTimeoutError",
    "RayTritonShmError",
    "RefusedError",
    "RequestTooLargeError",
    "ServerError",
    "ServerNotFoundError",
    "ServerStartError",
    "SettingsRefusedError",
    "SharedMemoryError",
    "SharedMemoryRefusedError",
    "SlotRefElsewhereError",
    "SlotRefError",
    "StaleSlotRefError",
    "TritonCallError",
    "UnavailableError",
]


class RayTritonShmError(Exception):
    """Root of every error raised by this package."""


class ConfigError(RayTritonShmError, ValueError):
    """A configuration value is invalid."""


class FrontDoorError(RayTritonShmError, OSError):
    """The front door (the replica's own HTTP and gRPC listeners) cannot listen where it is told to."""


class ServerError(RayTritonShmError):
    """Something went wrong with the Triton server process."""


class ServerNotFoundError(ServerError, FileNotFoundError):
    """No ``tritonserver`` binary could be found."""


class ServerStartError(ServerError):
    """The Triton server did not become ready.

    Args:
        message: What went wrong.
        log_tail: The last lines the server printed.
    """

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message, log_tail)
        self.message = message
        self.log_tail = log_tail

    def __str__(self) -> str:
        if not self.log_tail:
            return self.message
        return f"{self.message}\n--- last lines of the tritonserver log ---\n{self.log_tail}"


class SharedMemoryError(RayTritonShmError, OSError):
    """Creating, attaching or registering a shared-memory segment failed."""


class LayoutError(RayTritonShmError, ValueError):
    """A model cannot be laid out in shared-memory slots (e.g. BYTES tensors, unbounded dims)."""


class LayoutMismatchError(LayoutError):
    """A slot layout was about to be used against a model configuration it was not derived from.

    The model was reloaded with another configuration; get a new pool (a new
    client, or the node actor's new grant) for the new layout.

    Args:
        model: The model.
        layout_fingerprint: Fingerprint of the configuration the layout came from.
        server_fingerprint: Fingerprint of the configuration the server now runs
            (empty when only the retirement of the layout's pool is known).
    """

    def __init__(self, model: str, layout_fingerprint: str, server_fingerprint: str) -> None:
        super().__init__(model, layout_fingerprint, server_fingerprint)
        self.model = model
        self.layout_fingerprint = layout_fingerprint
        self.server_fingerprint = server_fingerprint

    def __str__(self) -> str:
        if not self.server_fingerprint:
            return (
                f"model {self.model!r} was reloaded on its node with another configuration: the pool "
                f"of this slot layout (derived from {self.layout_fingerprint}) was retired; the node "
                "grants a pool of the new layout"
            )
        return (
            f"model {self.model!r} now runs configuration {self.server_fingerprint}, but this slot "
            f"layout was derived from {self.layout_fingerprint}: the model was reloaded with another "
            "configuration; use a new client (or pool) for the new layout"
        )


class InputError(RayTritonShmError, ValueError):
    """Inputs given to ``infer`` do not match the model; nothing was written to shared memory."""


class RequestTooLargeError(InputError):
    """A request body (or what it inflates to) is larger than the ingress accepts (HTTP 413)."""


class PoolTimeoutError(RayTritonShmError, TimeoutError):
    """No slot became free within the timeout.

    Args:
        model: The model whose pool was exhausted.
        timeout_s: How long the caller waited.
        detail: Where the slots were when it gave up (in use here or elsewhere, pinned, held back).
    """

    def __init__(self, model: str, timeout_s: float, detail: str = "") -> None:
        super().__init__(model, timeout_s, detail)
        self.model = model
        self.timeout_s = timeout_s
        self.detail = detail

    def __str__(self) -> str:
        where = f" ({self.detail})" if self.detail else ""
        return (
            f"no shared-memory slot of model {self.model!r} became free within "
            f"{self.timeout_s:g} s{where}; raise the pool's slot count or the lease timeout"
        )


class PoolClosedError(RayTritonShmError, RuntimeError):
    """The slot pool (or client) has been closed."""


class LeaseReleasedError(RayTritonShmError, RuntimeError):
    """A lease was used after it was released."""


class SlotRefError(RayTritonShmError, ValueError):
    """A slot reference passed through a handle cannot be run (see ``SlotRefCaller``)."""


class StaleSlotRefError(SlotRefError):
    """The slot a reference names is not held by that lease (any more): nothing was run."""


class SlotRefElsewhereError(SlotRefError):
    """The reference names another node's (or another pool's) slot: send the arrays instead."""


class TritonCallError(RayTritonShmError):
    """Triton answered an inference or control call with an error.

    Args:
        message: Triton's message.
        status: The gRPC status code name, if known.
        model: The model the call was for, if any.
    """

    def __init__(self, message: str, status: str | None = None, model: str | None = None) -> None:
        super().__init__(message, status, model)
        self.message = message
        self.status = status
        self.model = model

    def __str__(self) -> str:
        where = f" (model {self.model!r})" if self.model else ""
        code = f"[{self.status}] " if self.status else ""
        return f"{code}{self.message}{where}"


class UnavailableError(TritonCallError):
    """Triton could not be reached (it died, restarted, or is not ready)."""


class CudaError(RayTritonShmError):
    """A CUDA shared-memory operation failed (allocation, IPC handle, registration with Triton)."""


class CudaUnavailableError(CudaError, ImportError):
    """CUDA memory was asked for but cupy cannot be imported.

    Args:
        message: What went wrong (includes the pip extra to install).
    """


class NoGpuError(CudaError):
    """cupy is installed but this process sees no (or not the requested) GPU."""


class DeviceMappingError(CudaError, ValueError):
    """A client's GPU cannot be named in the Triton server's device numbering.

    Raised when ``CUDA_VISIBLE_DEVICES`` of the client and of the server do
    not describe a common GPU, or use forms (index vs UUID) that cannot be
    compared without the GPUs' UUIDs.
    """


class OutputTooLargeError(TritonCallError):
    """An output is larger than the space its slot reserves; nothing was truncated.

    Raise ``PoolConfig.max_shapes`` for that output, or set
    ``ClientConfig.grpc_fallback`` to send such requests over plain gRPC.
    """


class RefusedError(RayTritonShmError):
    """The KServe ingress does not serve a request, and its message says why and what to use instead.

    Answered with the status Triton's own endpoint uses for the same kind of
    refusal: ``UNIMPLEMENTED`` (HTTP 501) for what the ingress does not offer,
    ``UNAVAILABLE`` (HTTP 503) for what the node's Triton is not configured to do.

    Args:
        message: Why, and what to use instead.
        status: The gRPC status code name of the answer.
    """

    def __init__(self, message: str, status: str = "UNIMPLEMENTED") -> None:
        super().__init__(message, status)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message


class OverloadedError(RefusedError):
    """A replica's front door has as many calls running as its deployment's ``max_ongoing_requests``.

    Answered ``UNAVAILABLE`` (HTTP 503), as Serve's own back-pressure: the client
    may try again (another replica may take it).

    Args:
        limit: The replica's ``max_ongoing_requests``.
    """

    def __init__(self, limit: int) -> None:
        RayTritonShmError.__init__(self, limit)
        self.limit = limit
        self.message = f"this replica is running its max_ongoing_requests ({limit}) calls; try again shortly"
        self.status = "UNAVAILABLE"


class SharedMemoryRefusedError(RefusedError):
    """A client asked the ingress to register a shared-memory region (system or CUDA).

    The app's shared memory lies on the server's own node and belongs to the
    app: a client elsewhere cannot share memory with it.
    """


class ModelControlRefusedError(RefusedError):
    """A model load or unload reached an app whose Triton does not run with explicit model control."""


class SettingsRefusedError(RefusedError):
    """A client asked the ingress to change the node Triton's log or trace settings."""
