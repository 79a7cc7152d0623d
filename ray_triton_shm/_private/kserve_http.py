"""KServe v2 inference over HTTP in a Serve replica, with one copy of each tensor each way.

A binary request (``Inference-Header-Content-Length``, ``Content-Length``, no
``Content-Encoding``) is decoded from its JSON header as soon as that has
arrived (:func:`~ray_triton_shm._private.kserve.plan_request`); a slot is
leased, and the tensor bytes that follow are written from each chunk Serve
hands over straight into the slot's input buffers (:class:`Scatter`): the
body is never joined into one ``bytes``. The answer is built from views of the
slot's outputs, copied once into the response body
(:func:`~ray_triton_shm._private.kserve.encode_response`), before the slot goes back.

The price: the slot is held while the tensor bytes arrive, not only during
Triton's call, so a slow upload keeps a slot of the model busy that long
(``slots_per_model`` and the pool size bound how many).

Every other request (JSON tensors, BYTES data, a compressed body, a model
without a slot layout, inputs the model refuses, a batch larger than one
slot, a payload small enough to go over gRPC) takes the general path: the
whole body, :func:`~ray_triton_shm._private.kserve.decode_request`, and
:meth:`NodeClient.ainfer`, exactly as before. Both paths answer the same.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ray_triton_shm._private import kserve
from ray_triton_shm._private.cuda import to_host
from ray_triton_shm._private.validate import check_inputs
from ray_triton_shm.errors import (
    InputError,
    LayoutMismatchError,
    OutputTooLargeError,
    RayTritonShmError,
)

logger = logging.getLogger(__name__)


async def request_body(
    request: Request, prefix: Sequence[bytes] = (), stream: AsyncIterator[bytes] | None = None
) -> bytes:
    """The request body, inflated when the client compressed it (``Content-Encoding``).

    Args:
        request: The request.
        prefix: Chunks of the body already read from ``stream``.
        stream: ``request.stream()`` when some of it was read already.

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
    """
    if stream is not None:
        chunks = list(prefix)
        async for chunk in stream:
            chunks.append(chunk)
        body = b"".join(chunks)
    else:
        body = await request.body()
    return inflate(body, request.headers.get("content-encoding"))


def inflate(body: bytes, content_encoding: str | None) -> bytes:
    """``body`` inflated as its ``Content-Encoding`` says (``gzip``, ``deflate``; none: as is).

    Raises:
        InputError: An unsupported encoding, or data that does not inflate.
    """
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise InputError(f"unsupported Content-Encoding {encoding!r}")
    try:
        return zlib.decompress(body, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    except zlib.error as e:
        raise InputError(f"request body is not valid {encoding} data: {e}") from e


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


def _pool_at_hand(client: Any, model: str) -> bool:
    """Whether ``client`` has a live pool of ``model`` and nothing to look up first (no I/O needed)."""
    try:
        pool = None if getattr(client, "_recheck", False) else client.client._pools.get(model)
    except RayTritonShmError:
        return False
    return pool is not None and not pool.retired


def shm_plan(client: Any, model: str, decoded: kserve.DecodedRequest) -> bool:
    """Whether ``client.ainfer`` would run ``decoded`` through one system-memory slot of ``model``.

    Any doubt (no layout, inputs the model refuses, several slots, a payload
    small enough for gRPC, GPU memory) answers ``False``: the general path then
    runs and gives the same answer or error as it always did.
    """
    from ray_triton_shm._private.slot_runs import chunks

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
        checked = check_inputs(layout, decoded.inputs)
        inner._wanted_outputs(layout, decoded.outputs)
    except RayTritonShmError:
        return False
    if pool.memory != "system" or checked.on_device or len(chunks(layout, checked.batch)) != 1:
        return False
    threshold = inner.config.pool_for(model).shm_threshold(over_http=inner._http is not None, cuda=False)
    return checked.nbytes >= threshold


async def http_infer(
    client: Any, model: str, request: Request, served_version: Callable[[str], Awaitable[str]]
) -> Response:
    """Answer one KServe v2 inference request for ``model`` through ``client`` (a :class:`NodeClient`).

    Raises:
        InputError, PoolTimeoutError, TritonCallError, UnavailableError: As
            :meth:`NodeClient.ainfer` (the caller turns them into KServe errors).
    """
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
            except InputError:
                planned = None  # the general path raises the same error
        if planned is not None and planned[1]:
            decoded, spans = planned
            # With the model's pool at hand the check is a few microseconds: no thread hop then.
            if (
                shm_plan(client, model, decoded)
                if _pool_at_hand(client, model)
                else (await asyncio.to_thread(shm_plan, client, model, decoded))
            ):
                return await _infer_in_slot(client, model, decoded, spans, rest, stream, served_version)
    body = await request_body(request, prefix, stream)
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
    rest: memoryview,
    stream: AsyncIterator[bytes],
    served_version: Callable[[str], Awaitable[str]],
) -> Response:
    """Lease a slot, write the body's tensor bytes into it as they arrive, run, answer from the slot."""
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
        scatter.feed(rest)
        async for chunk in stream:
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
