"""KServe v2 inference over HTTP in a Serve replica, with one copy of each tensor each way.

A binary request (``Inference-Header-Content-Length``, ``Content-Length``, no
``Content-Encoding``) is decoded from its JSON header as soon as that has
arrived (:func:`~ray_triton_shm._private.serve.protocol.kserve.plan_request`); the rest of
the body is read as the chunks Serve hands over (never joined into one
``bytes``), then a slot is leased and each chunk is written straight into the
slot's input buffers (:class:`Scatter`). A slow upload holds memory (at most
the body limit), never a slot. The answer is built from views of the slot's
outputs, copied once into the response body
(:func:`~ray_triton_shm._private.serve.protocol.kserve.encode_response`), before the slot goes back.

No body larger than ``max_bytes`` (``NodeConfig.max_request_bytes``, 64 MiB
by default as Triton's own HTTP limit) is read or inflated: a
``Content-Length`` past it is refused before any of the body is read, a
streamed body once it passes it, a compressed one once it inflates past it
(:class:`~ray_triton_shm.errors.RequestTooLargeError`, HTTP 413).

Every other request (JSON tensors, BYTES data, a compressed body, a model
without a slot layout, inputs the model refuses, a batch larger than one
slot, a payload small enough to go over gRPC) takes the general path: the
whole body, :func:`~ray_triton_shm._private.serve.protocol.kserve.decode_request`, and
:meth:`NodeClient.ainfer`. Both paths answer the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ray_triton_shm._private.node import node_config
from ray_triton_shm._private.serve.net import bounded
from ray_triton_shm._private.serve.protocol import kserve
from ray_triton_shm._private.serve.protocol.slot_plan import fast_path_lengths, pool_at_hand, shm_plan
from ray_triton_shm._private.shm.cuda import to_host
from ray_triton_shm.errors import (
    InputError,
    LayoutMismatchError,
    OutputTooLargeError,
    RefusedError,
)

logger = logging.getLogger(__name__)


def check_content_length(request: Request, max_bytes: int) -> None:
    """Refuse a request whose ``Content-Length`` is past ``max_bytes``, before its body is read.

    Raises:
        RequestTooLargeError: The announced body is too large.
    """
    text = (request.headers.get("content-length") or "").strip()
    if text.isdigit() and text.isascii() and int(text) > max_bytes:
        raise bounded.too_large(f"request body of {int(text)} bytes", max_bytes)


async def read_raw_body(
    request: Request,
    max_bytes: int,
    prefix: Sequence[bytes] = (),
    stream: AsyncIterator[bytes] | None = None,
) -> list[bytes | memoryview]:
    """The body's chunks as sent (not inflated), refused once past ``max_bytes``.

    Args:
        request: The request.
        max_bytes: Largest body accepted.
        prefix: Chunks of the body already read from ``stream``.
        stream: ``request.stream()`` when some of it was read already.

    Raises:
        RequestTooLargeError: The body (announced or as it arrives) is larger than ``max_bytes``.
    """
    check_content_length(request, max_bytes)
    return await _read_stream(stream if stream is not None else request.stream(), max_bytes, prefix)


async def _read_stream(
    stream: AsyncIterator[bytes], max_bytes: int, prefix: Sequence[bytes | memoryview] = ()
) -> list[bytes | memoryview]:
    """``prefix`` and the chunks still to come from ``stream``, refused once past ``max_bytes`` in all."""
    chunks = [chunk for chunk in prefix if len(chunk)]
    size = sum(len(chunk) for chunk in chunks)
    if size > max_bytes:
        raise bounded.too_large("request body", max_bytes)
    async for chunk in stream:
        if chunk:
            size += len(chunk)
            if size > max_bytes:
                raise bounded.too_large("request body", max_bytes)
            chunks.append(chunk)
    return chunks


def content_encoding(request: Request) -> str:
    """The request's ``Content-Encoding`` (``identity`` when absent), lower case."""
    return (request.headers.get("content-encoding") or "identity").strip().lower()


async def read_body(
    request: Request,
    max_bytes: int = node_config.MAX_REQUEST_BYTES,
    prefix: Sequence[bytes] = (),
    stream: AsyncIterator[bytes] | None = None,
) -> tuple[bytes, bytes]:
    """The body as sent and as meant (inflated when the client compressed it), each at most ``max_bytes``.

    Args:
        request: The request.
        max_bytes: Largest body accepted, before and after inflation.
        prefix: Chunks of the body already read from ``stream``.
        stream: ``request.stream()`` when some of it was read already.

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
        RequestTooLargeError: The body, or what it inflates to, is larger than ``max_bytes``.
    """
    encoding = content_encoding(request)
    if encoding not in ("identity", "gzip", "deflate"):  # refused before the body is read
        raise InputError(f"unsupported Content-Encoding {encoding!r}")
    raw = b"".join(await read_raw_body(request, max_bytes, prefix, stream))
    return raw, (raw if encoding == "identity" else bounded.inflate(raw, encoding, max_bytes))


async def request_body(
    request: Request,
    prefix: Sequence[bytes] = (),
    stream: AsyncIterator[bytes] | None = None,
    *,
    max_bytes: int = node_config.MAX_REQUEST_BYTES,
) -> bytes:
    """The request body, inflated when the client compressed it (``Content-Encoding``).

    Args:
        request: The request.
        prefix: Chunks of the body already read from ``stream``.
        stream: ``request.stream()`` when some of it was read already.
        max_bytes: Largest body accepted, before and after inflation.

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
        RequestTooLargeError: The body, or what it inflates to, is larger than ``max_bytes``.
    """
    return (await read_body(request, max_bytes, prefix, stream))[1]


class Scatter:
    """Writes a body's bytes, chunk by chunk, into the buffers of its binary spans.

    The spans follow one another to the end of the body (as the binary
    extension lays them out); each chunk is copied once, straight into its target.

    Args:
        targets: A writable byte buffer per span, in body order, each exactly the span's size.
    """

    def __init__(self, targets: Sequence[memoryview]) -> None:
        self._targets = [t for t in targets if len(t)]
        self._index = 0
        self._filled = 0

    @property
    def done(self) -> bool:
        return self._index == len(self._targets)

    def feed(self, chunk: bytes | memoryview) -> None:
        """Copy ``chunk`` (the next bytes of the body) into place.

        Raises:
            InputError: More bytes than the spans hold.
        """
        view = memoryview(chunk)
        while len(view):
            if self.done:
                raise InputError("the request body is longer than its Content-Length")
            target = self._targets[self._index]
            n = min(len(view), len(target) - self._filled)
            target[self._filled : self._filled + n] = view[:n]
            view = view[n:]
            self._filled += n
            if self._filled == len(target):
                self._index += 1
                self._filled = 0


async def _read_header(stream: AsyncIterator[bytes], length: int) -> tuple[list[bytes], bytes, memoryview]:
    """Chunks read until ``length`` bytes have come: (chunks, the header, the rest of the last chunk)."""
    chunks: list[bytes] = []
    have = 0
    while have < length:
        try:
            chunk = await anext(stream)
        except StopAsyncIteration:
            break
        chunks.append(chunk)
        have += len(chunk)
    if len(chunks) == 1:  # the usual case: no join of a large first chunk
        header = memoryview(chunks[0])[:length]
    else:
        header = memoryview(b"".join(chunks))[:length]
    rest = memoryview(chunks[-1])[len(chunks[-1]) - (have - length) :] if have > length else memoryview(b"")
    return chunks, bytes(header), rest


async def http_infer(
    client: Any,
    model: str,
    request: Request,
    served_version: Callable[[str], Awaitable[str]],
    *,
    max_bytes: int = node_config.MAX_REQUEST_BYTES,
) -> Response:
    """Answer one KServe v2 inference request for ``model`` through ``client`` (a :class:`NodeClient`).

    Args:
        client: The replica's :class:`NodeClient`.
        model: The model named in the path.
        request: The request.
        served_version: The version Triton serves of a model (for the answer).
        max_bytes: Largest body accepted, before and after inflation.

    Raises:
        RequestTooLargeError: The body, or what it inflates to, is larger than ``max_bytes``.
        InputError, PoolTimeoutError, TritonCallError, UnavailableError: As
            :meth:`NodeClient.ainfer` (the caller turns them into KServe errors).
    """
    check_content_length(request, max_bytes)
    lengths = fast_path_lengths(request.headers)
    prefix: list[bytes] = []
    stream = None
    if lengths is not None:
        header_length, body_length = lengths
        stream = request.stream().__aiter__()
        prefix, header, rest = await _read_header(stream, min(header_length, body_length))
        planned = None
        if len(header) == min(header_length, body_length):
            try:
                planned = kserve.plan_request(header, header_length, body_length)
            except (InputError, RefusedError):
                planned = None  # the general path raises the same error
        if planned is not None and planned[1]:
            decoded, spans = planned
            # With the model's pool at hand the check is a few microseconds: no thread hop then.
            if (
                shm_plan(client, model, decoded.inputs, decoded.outputs)
                if pool_at_hand(client, model)
                else (await asyncio.to_thread(shm_plan, client, model, decoded.inputs, decoded.outputs))
            ):
                # The rest of the body arrives before a slot is leased: a slow upload holds no slot.
                chunks = await _read_stream(stream, max_bytes - len(header), [rest])
                return await _infer_in_slot(client, model, decoded, spans, chunks, served_version)
    body = await request_body(request, prefix, stream, max_bytes=max_bytes)
    header_length = kserve.parse_header_length(request.headers.get(kserve.HEADER_LENGTH))
    decoded = kserve.decode_request(body, header_length)
    version = await served_version(model)
    # Encoding the answer copies the outputs: read them straight from the slot, which stays
    # pinned only until the answer is encoded (nothing awaited in between).
    outputs = await client.ainfer(model, decoded.inputs, outputs=decoded.outputs, copy=False)
    host = {name: to_host(value) for name, value in outputs.items()}
    payload, headers = kserve.encode_response(model, decoded, host, version)
    del outputs, host
    return Response(payload, headers=headers)


async def _infer_in_slot(
    client: Any,
    model: str,
    decoded: kserve.DecodedRequest,
    spans: list[kserve.BinarySpan],
    chunks: Sequence[bytes | memoryview],
    served_version: Callable[[str], Awaitable[str]],
) -> Response:
    """Lease a slot, write the body's tensor bytes (``chunks``, read already) into it, run, answer from it."""
    version = await served_version(model)
    with await client.alease(model) as lease:
        targets = []
        for span in spans:
            view = lease.input(span.name, decoded.inputs[span.name].shape)
            targets.append(memoryview(view.reshape(-1).view(np.uint8)))
        for name, array in decoded.inputs.items():  # JSON inputs of the same request
            if all(span.name != name for span in spans):
                lease.input(name, array.shape)[...] = array
        scatter = Scatter(targets)
        for chunk in chunks:
            scatter.feed(chunk)
        if not scatter.done:
            raise InputError("the request body is shorter than its Content-Length")
        del targets
        try:
            outputs = await client.arun(lease, decoded.outputs)
        except (LayoutMismatchError, OutputTooLargeError) as e:
            # What ainfer handles itself (a reloaded model, an output over its slot): take the inputs
            # out of the slot and let it.
            inputs = {name: np.array(lease.input(name, a.shape)) for name, a in decoded.inputs.items()}
            lease.release()
            if isinstance(e, LayoutMismatchError):
                await asyncio.to_thread(client._layout_changed, e)
            outputs = await client.ainfer(model, inputs, outputs=decoded.outputs)
        payload, headers = kserve.encode_response(model, decoded, dict(outputs), version)
        del outputs
    return Response(payload, headers=headers)
