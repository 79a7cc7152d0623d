"""What an error answer of the KServe v2 ingress says: Triton's status codes, and nothing internal."""

from __future__ import annotations

import json
import logging
import re

import ray

from ray_triton_shm._private.shm.segment import redact
from ray_triton_shm.errors import (
    InputError,
    LayoutError,
    PoolTimeoutError,
    RayTritonShmError,
    RefusedError,
    RequestTooLargeError,
    TritonCallError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

# Triton's HTTP endpoint answers a failed call with the code of its error kind; over gRPC the
# same kinds carry these status names (Triton's HttpCodeFromError and its gRPC mapping).
_HTTP_BY_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNKNOWN": 400,
    "ALREADY_EXISTS": 400,
    "CANCELLED": 400,
    "NOT_FOUND": 404,
    "INTERNAL": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def http_status(error: BaseException) -> int:
    """The HTTP status Triton's endpoint would answer for ``error`` (ours: 503 for a pool timeout).

    Bad requests (:class:`InputError`) are 400, and 413 when the body is too
    large (:class:`RequestTooLargeError`); Triton's own refusals keep the
    code of their kind (unknown model or version 404, invalid argument 400,
    unavailable 503), and so do the ingress's own refusals (:class:`RefusedError`:
    unsupported 501, unavailable 503); a model that cannot use shared-memory slots is 501
    (Triton serves it, this ingress cannot); anything else is 500.
    """
    if isinstance(error, RequestTooLargeError):
        return 413
    if isinstance(error, InputError):
        return 400
    if isinstance(error, LayoutError):
        return 501
    if isinstance(error, PoolTimeoutError):
        return 503
    if isinstance(error, UnavailableError):
        return 503
    if isinstance(error, (TritonCallError, RefusedError)):
        return _HTTP_BY_STATUS.get(error.status or "", 500)
    return 500


# What must not leave the node in an error answer: addresses (Triton's loopback endpoints, as
# gRPC and our transports name them) and long hex ids (Ray node ids).
_INTERNALS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract):"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"
    r"|\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\]"
    r"|\blocalhost:\d+"
    r"|\b[0-9a-f]{40,}\b"
)
_GENERIC = {
    503: "the inference server on this node is unavailable; try again shortly",
    504: "the inference server on this node did not answer in time",
}


def names_internals(message: str) -> bool:
    """Whether ``message`` names an address or an id of this node (see :func:`error_message`)."""
    return _INTERNALS.search(message) is not None


def error_message(error: BaseException) -> str:
    """The text of an error answer: Triton's own message for Triton's refusals, else ours.

    What a client may read, never the node's internals: a message that names
    an address, port or node id (a transport failure, a restarting node) is
    replaced by a plain one of its status, the pool's occupancy is left out of
    a pool timeout, the ingress's own refusals say why, and an error that is not the client's or Triton's is
    ``internal error (<type>)``. The full text is logged instead. Segment
    keys are redacted.
    """
    if isinstance(error, InputError | LayoutError | RefusedError):
        return redact(str(error))
    if isinstance(error, PoolTimeoutError):
        if error.detail:
            logger.info("ingress: %s", error)
        return redact(str(PoolTimeoutError(error.model, error.timeout_s)))
    if isinstance(error, TritonCallError):
        message = redact(error.message)
        if not names_internals(message):
            return message
        code = http_status(error)
        logger.warning("ingress: answered %d for: %s", code, error)
        return _GENERIC.get(code, "internal error")
    logger.warning("ingress: answered %d for: %s", http_status(error), error, exc_info=error)
    return f"internal error ({type(error).__name__})"


def error_body(message: str) -> bytes:
    """The v2 error object."""
    return json.dumps({"error": message}).encode()


def error_answer(error: BaseException) -> tuple[int, bytes]:
    """The KServe error answer (status, body) for ``error``; never Ray's task header or a traceback.

    A Ray task error is answered as its cause; the node actor gone (or not
    answering) is 503; an error that is neither ours nor the client's is 500.
    """
    cause = error
    while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, Exception):
        cause = cause.cause
    if isinstance(cause, RayTritonShmError):
        return http_status(cause), error_body(redact(error_message(cause)))
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
        logger.warning("node actor unavailable: %s", type(cause).__name__)
        return 503, error_body("the Triton node actor on this node is unavailable")
    logger.exception("unexpected error in the KServe ingress")
    return 500, error_body(f"internal error ({type(cause).__name__})")
