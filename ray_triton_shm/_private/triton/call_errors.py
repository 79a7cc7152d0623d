"""Triton's error answers turned into our typed errors, whichever transport carried them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_triton_shm._private.shm.segment import redact
from ray_triton_shm.errors import OutputTooLargeError, TritonCallError, UnavailableError

if TYPE_CHECKING:
    from tritonclient.utils import InferenceServerException

IN_DOUBT_STATUSES = ("DEADLINE_EXCEEDED", "CANCELLED")
"""After these the server may still be working on the request (and writing into its slot)."""


def call_error(message: str, status: str | None, model: str | None = None) -> TritonCallError:
    """Our error for Triton's ``message`` with gRPC status name ``status``; segment keys redacted."""
    message = redact(message)
    if "protocol is restricted" in message or "API is restricted" in message:
        return TritonCallError(
            f"{message}; the server protects its shared-memory endpoints: pass its "
            "TritonServer.shm_api_key as ClientConfig.shm_api_key",
            status,
            model,
        )
    if status == "UNAVAILABLE":
        return UnavailableError(message, status, model)
    if "should be at least" in message and "to hold the results" in message:
        return OutputTooLargeError(
            f"{message}; raise PoolConfig.max_shapes for it or set ClientConfig.grpc_fallback",
            status,
            model,
        )
    return TritonCallError(message, status, model)


def region_unknown(error: TritonCallError) -> bool:
    """Whether Triton answered that a shared-memory region of the request is not registered."""
    return error.status == "NOT_FOUND" and "shared memory region" in error.message


def status_name(error: InferenceServerException) -> str | None:
    """The gRPC status name (``"NOT_FOUND"``) of a tritonclient exception, or ``None``."""
    status = error.status()
    return str(status).rsplit(".", 1)[-1] if status else None


def translate_error(error: InferenceServerException, model: str | None = None) -> TritonCallError:
    """Turn a tritonclient exception into ours (typed by gRPC status), segment keys redacted."""
    return call_error(str(error.message() or error), status_name(error), model)
