"""The KServe v2 / Triton HTTP inference protocol: decoding requests, encoding responses.

Supports JSON tensors and the binary-tensor extension (a JSON header whose
length is given by ``Inference-Header-Content-Length``, followed by raw
tensor bytes), which is what ``tritonclient.http`` sends by default.

JSON tensors are read and written by :mod:`kserve_json` (in C where the extension is
built), with the json module's meaning and text.

Every malformed request raises :class:`InputError` (HTTP 400, as Triton
answers it); :func:`kserve_errors.http_status` maps our other errors to the status codes
Triton's own HTTP endpoint uses for the same failures. What a client may send
(body size, JSON, shapes) is in ``kserve_limits``, what an error answer may
say in ``kserve_errors``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np

from ray_triton_shm._private.serve.protocol.kserve_json import (
    JsonNumbers,
    RawJson,
    SlowPath,
    dumps,
    loads_numbers,
    numbers_json,
)
from ray_triton_shm._private.serve.protocol.kserve_limits import MAX_RANK, check_shape, load_json
from ray_triton_shm._private.serve.protocol.kserve_tensors import (
    deserialize_bytes,
    placeholder,
    serialize_bytes,
)
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON, TRITON_TO_NUMPY
from ray_triton_shm.errors import InputError, RefusedError

HEADER_LENGTH = "inference-header-content-length"


def _json_bytes(values: Any) -> np.ndarray:
    flat = np.asarray(values, dtype=object).ravel()
    out = np.empty(flat.size, dtype=object)
    for i, item in enumerate(flat):
        if not isinstance(item, str):
            raise InputError(f"BYTES data in JSON must be strings, got {type(item).__name__}")
        out[i] = item.encode("utf-8")
    return out


@dataclass(frozen=True)
class DecodedRequest:
    """An inference request: inputs, the outputs asked for and how to send them back."""

    inputs: dict[str, np.ndarray]
    outputs: list[str] | None
    binary_outputs: dict[str, bool]
    default_binary: bool
    request_id: str | None


def parse_header_length(value: str | None) -> int | None:
    """The value of ``Inference-Header-Content-Length`` (``None`` when absent).

    Raises:
        InputError: The value is not a non-negative decimal integer.
    """
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        raise InputError(f"Inference-Header-Content-Length must be a non-negative integer, got {value!r}")
    return int(text)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object (``None`` counts as an empty one)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _flatten(data: Any, name: str) -> list[Any]:
    """The scalars of ``data`` (a JSON array, possibly nested) in row-major order."""
    if not isinstance(data, list):
        raise InputError(f"input {name!r}: 'data' must be a JSON array")
    flat = data
    while True:  # whole levels of arrays at once (as ``[[...], [...]]``), in C
        kinds = set(map(type, flat))
        if list not in kinds:
            return flat
        if kinds != {list}:
            break
        flat = list(itertools.chain.from_iterable(flat))
    scalars: list[Any] = []  # arrays and scalars side by side: one element at a time
    stack = [iter(flat)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            scalars.append(item)
        else:
            stack.pop()
    return scalars


_ACCEPTED_TYPES = {"b": frozenset({bool}), "i": frozenset({int}), "u": frozenset({int})}
_NUMBER_TYPES = frozenset({int, float})


def _json_tensor(data: Any, name: str, datatype: str, dtype: np.dtype) -> np.ndarray:
    """The array of a JSON ``data`` field, each element checked against ``datatype``."""
    flat = _flatten(data, name)
    # The element types JSON gives, checked as a set; any other (or a subclass) one by one.
    if not set(map(type, flat)) <= _ACCEPTED_TYPES.get(dtype.kind, _NUMBER_TYPES):
        for value in flat:
            if not _accepts(dtype, value):
                raise InputError(f"input {name!r}: {value!r} is not a {datatype} value")
    try:
        return np.asarray(flat, dtype=dtype)
    except (OverflowError, ValueError) as e:
        raise InputError(f"input {name!r}: a value is out of range for {datatype}") from e


def _accepts(dtype: np.dtype, value: Any) -> bool:
    if dtype.kind == "b":
        return isinstance(value, bool)
    if dtype.kind in "iu":
        return _is_int(value)
    return _is_int(value) or isinstance(value, float)


def _shape(entry: dict[str, Any], name: str) -> list[int]:
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        if isinstance(shape, list) and len(shape) > MAX_RANK:  # not quoted: it can be long
            raise InputError(f"input {name!r}: a shape of {len(shape)} dimensions has more than {MAX_RANK}")
        raise InputError(f"input {name!r}: 'shape' must be an array of non-negative integers, got {shape!r}")
    check_shape(name, shape)
    return shape


SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
"""Tensor parameters that name a registered shared-memory region: never accepted from a client."""

CLASSIFICATION = "classification"
"""The output parameter of Triton's classification extension (tritonclient's ``class_count``)."""


def classification_refused(name: str) -> RefusedError:
    """The refusal of an output asked for as its top classes (``UNIMPLEMENTED``, HTTP 501)."""
    return RefusedError(
        f"output {name!r}: classification (the output parameter 'classification', tritonclient's "
        "class_count) is not supported by this endpoint; ask for the output itself and take its top classes"
    )


def refuse_shm_parameters(body: bytes, header_length: int | None) -> None:
    """Refuse a request whose inputs or outputs name shared-memory regions, or that no parser should see.

    The node's regions are ours: a client of the ingress must not make Triton
    read or write them. Requests passed to Triton as they are (a pinned model
    version) are checked with this; the rest are decoded by
    :func:`decode_request`, which never takes data from a region. Its JSON
    is parsed as :func:`load_json` parses it, and its input shapes checked as
    :func:`check_shape` checks them (Triton answers some of them with an
    internal error); everything else is Triton's to judge.

    Raises:
        InputError: A tensor has shared-memory parameters or a shape no tensor
            can have, or the JSON header is malformed (see :func:`load_json`: a
            key given twice is refused, so that Triton cannot read another copy
            of it than the one checked).
    """
    split = len(body) if header_length is None else header_length
    if split < 0 or split > len(body):
        raise InputError(f"Inference-Header-Content-Length {split} is outside the body of {len(body)} bytes")
    text = body[:split]
    header = loads_numbers(text)  # tensors' numbers in one buffer each, where the C reader takes them
    if header is None:
        header = load_json(text)
    if isinstance(header, dict):  # otherwise Triton refuses it itself
        _refuse_shm(header)
        inputs = header.get("inputs")
        for entry in inputs if isinstance(inputs, list) else ():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if isinstance(shape, list) and all(_is_int(d) for d in shape):  # else Triton refuses it
                check_shape(str(entry.get("name")), shape)


def _refuse_shm(header: dict[str, Any]) -> None:
    for kind in ("inputs", "outputs"):
        entries = header.get(kind)
        for entry in entries if isinstance(entries, list) else ():
            params = entry.get("parameters") if isinstance(entry, dict) else None
            if isinstance(params, dict) and any(key in params for key in SHM_PARAMETERS):
                name = entry.get("name")
                raise InputError(
                    f"{kind[:-1]} {name!r}: shared-memory parameters are not accepted by this ingress"
                )


@dataclass(frozen=True)
class BinarySpan:
    """Where a binary input's bytes lie in the request body (see :func:`plan_request`)."""

    name: str
    start: int
    size: int


class _NotPlannable(Exception):
    """A request :func:`plan_request` cannot describe without its data (BYTES binary data)."""


def plan_request(
    header: bytes | memoryview, header_length: int, body_length: int
) -> tuple[DecodedRequest, list[BinarySpan]] | None:
    """Decode a binary-extension request from its JSON header alone, before its tensor data arrives.

    Every check of :func:`decode_request` runs, in the same order, with the
    body taken to be ``body_length`` bytes long. Binary inputs come back as
    read-only placeholders of their dtype and shape (no memory behind them),
    and the spans of the body that hold their bytes (one after another, to
    the end of the body).

    Args:
        header: The first ``header_length`` bytes of the body.
        header_length: Value of ``Inference-Header-Content-Length``.
        body_length: Length of the whole body (``Content-Length``).

    Returns:
        The request and the spans, or ``None`` when an input's data must be
        read to decode it (BYTES binary data): decode the whole body then.

    Raises:
        InputError: As :func:`decode_request` (with the body it would get).
    """
    if len(header) != min(header_length, body_length):
        raise ValueError("header must be exactly the first header_length bytes of the body")
    spans: list[BinarySpan] = []
    try:
        return _decode(header, body_length, header_length, spans), spans
    except _NotPlannable:
        return None


def decode_request(body: bytes | bytearray, header_length: int | None) -> DecodedRequest:
    """Parse a v2 inference request body.

    Args:
        body: The HTTP body.
        header_length: Value of ``Inference-Header-Content-Length``, if present
            (see :func:`parse_header_length`).

    Returns:
        The decoded request.

    Raises:
        InputError: Malformed JSON, a field of the wrong type, an unknown
            datatype, values that are not of the tensor's datatype, sizes that
            do not add up.
    """
    return _decode(body, len(body), header_length, None)


def _decode(
    body: bytes | bytearray | memoryview,
    length: int,
    header_length: int | None,
    spans: list[BinarySpan] | None,
) -> DecodedRequest:
    """:func:`decode_request` of a body of ``length`` bytes; with ``spans``, ``body`` is its header only."""
    split = length if header_length is None else header_length
    if split < 0 or split > length:
        raise InputError(f"Inference-Header-Content-Length {split} is outside the body of {length} bytes")
    text = body if split == length else body[:split]  # the whole body: not copied
    header = loads_numbers(text)
    if header is not None:
        try:
            return _decode_header(header, body, length, split, spans)
        except (InputError, RefusedError, SlowPath):
            # What a request means, and what is wrong with it, is the json module's reading.
            if spans is not None:
                spans.clear()
    return _decode_header(load_json(text), body, length, split, spans)


def _decode_header(
    header: Any,
    body: bytes | bytearray | memoryview,
    length: int,
    split: int,
    spans: list[BinarySpan] | None,
) -> DecodedRequest:
    """:func:`_decode` of the parsed JSON ``header`` (the first ``split`` bytes of the body)."""
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InputError("request must be a JSON object with an 'inputs' list")
    _refuse_shm(header)
    inputs: dict[str, np.ndarray] = {}
    cursor = split
    for entry in header["inputs"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InputError(f"input entry must be an object with a string 'name': {entry!r}")
        name = entry["name"]
        if name in inputs:
            raise InputError(f"input {name!r} is given twice")
        datatype = entry.get("datatype")
        dtype = TRITON_TO_NUMPY.get(datatype) if isinstance(datatype, str) else None
        if dtype is None and datatype != "BYTES":
            raise InputError(f"input {name!r}: datatype {datatype!r} is not supported")
        shape = _shape(entry, name)
        count = math.prod(shape)
        size = _object(entry.get("parameters"), f"input {name!r} parameters").get("binary_data_size")
        if size is not None:
            if not _is_int(size) or size < 0:
                raise InputError(f"input {name!r}: binary_data_size must be a non-negative integer")
            if cursor + size > length:
                raise InputError(f"input {name!r}: binary data runs past the end of the body")
            if dtype is None:
                if spans is not None:
                    raise _NotPlannable(name)
                array = deserialize_bytes(memoryview(body)[cursor : cursor + size])
            else:
                if size != count * dtype.itemsize:
                    raise InputError(
                        f"input {name!r}: {size} bytes of binary data do not match"
                        f" shape {shape} of {datatype}"
                    )
                if spans is None:
                    array = np.frombuffer(body, dtype=dtype, count=count, offset=cursor)
                else:  # a placeholder of the right dtype and shape: no memory behind it
                    array = placeholder(shape, dtype)
                    spans.append(BinarySpan(name, cursor, size))
            cursor += size
        elif "data" in entry:
            data = entry["data"]
            if isinstance(data, JsonNumbers):
                if dtype is None:
                    raise SlowPath()
                array = data.tensor(dtype)
            else:
                array = _json_bytes(data) if dtype is None else _json_tensor(data, name, datatype, dtype)
        else:
            raise InputError(f"input {name!r} has neither 'data' nor binary_data_size")
        if array.size != count:
            raise InputError(f"input {name!r}: {array.size} elements do not fill shape {shape}")
        inputs[name] = array.reshape(shape)
    if cursor != length:
        raise InputError(f"{length - cursor} bytes after the last input's binary data")
    params = _object(header.get("parameters"), "request parameters")
    default_binary = params.get("binary_data_output", False)
    if not isinstance(default_binary, bool):
        raise InputError("parameter binary_data_output must be a boolean")
    outputs = None
    binary_outputs: dict[str, bool] = {}
    requested = header.get("outputs")
    if requested is not None and not isinstance(requested, list):
        raise InputError("'outputs' must be an array")
    if requested:
        outputs = []
        for entry in requested:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise InputError(f"output entry must be an object with a string 'name': {entry!r}")
            out_params = _object(entry.get("parameters"), f"output {entry['name']!r} parameters")
            if out_params.get(CLASSIFICATION, 0) != 0:
                raise classification_refused(entry["name"])
            flag = out_params.get("binary_data")
            if flag is not None and not isinstance(flag, bool):
                raise InputError(f"output {entry['name']!r}: binary_data must be a boolean")
            outputs.append(entry["name"])
            binary_outputs[entry["name"]] = default_binary if flag is None else flag
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InputError("'id' must be a string")
    return DecodedRequest(inputs, outputs, binary_outputs, default_binary, request_id)


def encode_response(
    model: str, request: DecodedRequest, outputs: dict[str, np.ndarray], version: str = "1"
) -> tuple[bytes, dict[str, str]]:
    """Build a v2 response body and headers for ``outputs``.

    Binary outputs are copied once, straight from ``outputs`` (views of a
    slot, say) into the body: ``outputs`` need to stay valid only until this
    returns.

    Returns:
        The body and the headers to send (content type, header length if binary).
    """
    parts, headers = encode_response_parts(model, request, outputs, version)
    return parts[0] if len(parts) == 1 else b"".join(parts), headers


def encode_response_parts(
    model: str, request: DecodedRequest, outputs: dict[str, np.ndarray], version: str = "1"
) -> tuple[list[bytes | np.ndarray], dict[str, str]]:
    """:func:`encode_response` without the join: the JSON header, then each binary output's bytes.

    The binary parts are byte views of ``outputs`` (no copy): they must stay
    valid until the parts are written (a server writes them to its socket as they are).

    Returns:
        The body's parts, in order, and the headers to send.
    """
    entries = []
    blobs: list[bytes | np.ndarray] = []
    raw = False  # some output's data is JSON text already (RawJson)
    for name, array in outputs.items():
        array = np.ascontiguousarray(array)
        is_bytes = array.dtype == object
        entry: dict[str, Any] = {
            "name": name,
            "datatype": "BYTES" if is_bytes else NUMPY_TO_TRITON[array.dtype],
            "shape": list(array.shape),
        }
        if request.binary_outputs.get(name, request.default_binary):
            # Numeric data as a byte view of the array: the join below is its only copy.
            blob = serialize_bytes(array) if is_bytes else array.reshape(-1).view(np.uint8)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif is_bytes:
            entry["data"] = [
                item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
                for item in array.flat
            ]
        else:
            text = numbers_json(array)
            entry["data"] = array.ravel().tolist() if text is None else RawJson(text)
            raw = raw or text is not None
        entries.append(entry)
    reply: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.request_id:
        reply["id"] = request.request_id
    head = dumps(reply) if raw else json.dumps(reply).encode()
    if not blobs:
        return [head], {"content-type": "application/json"}
    return [head, *blobs], {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def route_path(scope: Mapping[str, Any]) -> str:
    """The request path below the app's ``route_prefix`` (Serve keeps the prefix in ``root_path``).

    Example:
        >>> route_path({"path": "/triton/v2/health/ready", "root_path": "/triton"})
        '/v2/health/ready'
    """
    path = str(scope.get("path") or "/")
    root = str(scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path or "/"


def triton_path(path: str, query: str) -> str:
    """``path`` (as Serve decoded it) quoted again, plus the query, for the request to Triton.

    Example:
        >>> triton_path("/v2/models/my model/ready", "")
        '/v2/models/my%20model/ready'
    """
    quoted = "/".join(quote(part, safe="") for part in path.split("/"))
    return f"{quoted}?{query}" if query else quoted
