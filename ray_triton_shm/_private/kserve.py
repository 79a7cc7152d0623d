"""The KServe v2 / Triton HTTP inference protocol: decoding requests, encoding responses.

Supports JSON tensors and the binary-tensor extension (a JSON header whose
length is given by ``Inference-Header-Content-Length``, followed by raw
tensor bytes), which is what ``tritonclient.http`` sends by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_triton_shm._private.layout import NUMPY_TO_TRITON, TRITON_TO_NUMPY
from ray_triton_shm.errors import InputError

HEADER_LENGTH = "inference-header-content-length"


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor in Triton's serialised form: per element a 4-byte little-endian length, its bytes."""
    parts = []
    for item in array.flat:
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(data: bytes | memoryview, count: int | None = None) -> np.ndarray:
    """Parse Triton's serialised BYTES form into a flat object array of ``bytes``.

    Args:
        data: The serialised elements.
        count: Elements expected; ``None`` reads to the end of ``data``.

    Raises:
        InputError: A length runs past the data, or the element count is wrong.
    """
    view = memoryview(data)
    items = []
    cursor = 0
    while cursor < len(view) and (count is None or len(items) < count):
        if cursor + 4 > len(view):
            raise InputError("BYTES data ends inside an element's 4-byte length")
        size = int.from_bytes(view[cursor : cursor + 4], "little")
        cursor += 4
        if cursor + size > len(view):
            raise InputError("a BYTES element runs past the end of its data")
        items.append(bytes(view[cursor : cursor + size]))
        cursor += size
    if count is not None and (len(items) != count or cursor != len(view)):
        raise InputError(f"BYTES data does not hold exactly {count} elements")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


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


def decode_request(body: bytes, header_length: int | None) -> DecodedRequest:
    """Parse a v2 inference request body.

    Args:
        body: The HTTP body.
        header_length: Value of ``Inference-Header-Content-Length``, if present.

    Returns:
        The decoded request.

    Raises:
        InputError: Malformed JSON, unknown datatype, sizes that do not add up.
    """
    split = len(body) if header_length is None else header_length
    if split < 0 or split > len(body):
        raise InputError(f"Inference-Header-Content-Length {split} is outside the body")
    try:
        header = json.loads(body[:split] or b"{}")
    except json.JSONDecodeError as e:
        raise InputError(f"request JSON is malformed: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InputError("request must be a JSON object with an 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    cursor = split
    for entry in header["inputs"]:
        try:
            name, datatype, shape = entry["name"], entry["datatype"], [int(d) for d in entry["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"input entry needs name, datatype and shape: {entry!r}") from e
        dtype = TRITON_TO_NUMPY.get(datatype)
        if dtype is None and datatype != "BYTES":
            raise InputError(f"input {name!r}: datatype {datatype!r} is not supported")
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            size = int(size)
            if cursor + size > len(body):
                raise InputError(f"input {name!r}: binary data runs past the end of the body")
            if dtype is None:
                array = deserialize_bytes(memoryview(body)[cursor : cursor + size])
            else:
                array = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=cursor)
            cursor += size
        elif "data" in entry:
            array = _json_bytes(entry["data"]) if dtype is None else np.asarray(entry["data"], dtype=dtype)
        else:
            raise InputError(f"input {name!r} has neither 'data' nor binary_data_size")
        if array.size != int(np.prod(shape)):
            raise InputError(f"input {name!r}: {array.size} elements do not fill shape {shape}")
        inputs[name] = array.reshape(shape)
    params = header.get("parameters") or {}
    default_binary = bool(params.get("binary_data_output", False))
    outputs = None
    binary_outputs: dict[str, bool] = {}
    if header.get("outputs"):
        outputs = []
        for entry in header["outputs"]:
            outputs.append(entry["name"])
            flag = (entry.get("parameters") or {}).get("binary_data")
            binary_outputs[entry["name"]] = default_binary if flag is None else bool(flag)
    return DecodedRequest(inputs, outputs, binary_outputs, default_binary, header.get("id"))


def encode_response(
    model: str, request: DecodedRequest, outputs: dict[str, np.ndarray], version: str = "1"
) -> tuple[bytes, dict[str, str]]:
    """Build a v2 response body and headers for ``outputs``.

    Returns:
        The body and the headers to send (content type, header length if binary).
    """
    entries = []
    blobs = []
    for name, array in outputs.items():
        array = np.ascontiguousarray(array)
        is_bytes = array.dtype == object
        entry: dict[str, Any] = {
            "name": name,
            "datatype": "BYTES" if is_bytes else NUMPY_TO_TRITON[array.dtype],
            "shape": list(array.shape),
        }
        if request.binary_outputs.get(name, request.default_binary):
            blob = serialize_bytes(array) if is_bytes else array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif is_bytes:
            entry["data"] = [
                item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
                for item in array.flat
            ]
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    reply: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.request_id:
        reply["id"] = request.request_id
    head = json.dumps(reply).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def error_body(message: str) -> bytes:
    """The v2 error object."""
    return json.dumps({"error": message}).encode()
