"""``ModelInfer`` messages as bytes: the raw tensors found, placed and written without a parse or a join.

* :func:`split_infer_request`: a request's description parsed, its raw input
  contents left as views of the message's bytes;
* :func:`raw_start` and :func:`plan_inputs`: where a request's raw inputs begin,
  and what they are, from the message's head alone (to read them into a slot);
* :func:`encode_infer_response_parts`: an answer as its small fields followed by
  the outputs' bytes, sent as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ray_triton_shm._private.serve.protocol.grpc_messages import add_outputs, input_spec, output_names
from ray_triton_shm._private.serve.protocol.kserve_tensors import placeholder
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON
from ray_triton_shm.errors import InputError, RefusedError

_RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
RAW_INPUT_KEY = bytes([(_RAW_INPUT_FIELD << 3) | 2])
_RAW_OUTPUT_KEY = bytes([(6 << 3) | 2])  # ModelInferResponse.raw_output_contents, length-delimited


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(data) and data[pos] < 0x80:  # one byte: most keys and short lengths
        return data[pos], pos + 1
    value = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise InputError("the ModelInferRequest message is malformed (a varint runs past its end)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _field(view: memoryview, pos: int) -> tuple[int, int, int, int]:
    """The field at ``pos``: its number, its wire type, where its value starts and where it ends.

    Raises:
        InputError: A varint runs past the end, or a wire type protobuf does not use.
    """
    key, pos = _varint(view, pos)
    field, wire = key >> 3, key & 7
    if wire == 2:
        length, pos = _varint(view, pos)
        return field, wire, pos, pos + length
    if wire == 0:
        return field, wire, pos, _varint(view, pos)[1]
    if wire in (1, 5):
        return field, wire, pos, pos + (8 if wire == 1 else 4)
    raise InputError(f"the ModelInferRequest message is malformed (wire type {wire})")


def raw_start(head: bytes) -> int | None:
    """Where the first raw input's field begins in ``head`` (the start of a ``ModelInferRequest``).

    ``None``: ``head`` ends first, has no raw input, or is not a well-formed message.
    """
    view = memoryview(head)
    pos = 0
    try:
        while pos < len(view):
            field, wire, _, end = _field(view, pos)
            if field == _RAW_INPUT_FIELD and wire == 2:
                return pos
            pos = end
    except InputError:
        return None
    return None


def plan_inputs(request: pb.ModelInferRequest) -> tuple[dict[str, np.ndarray], list[str] | None] | None:
    """Placeholders (no memory behind them) of a request's raw inputs, and the outputs it asks for.

    ``None`` for a request :func:`decode_infer_request` would refuse or
    read otherwise: typed contents, shared-memory parameters, an unknown or
    BYTES datatype, a shape no tensor has, an input given twice, an output
    asked for as its top classes.
    """
    placeholders: dict[str, np.ndarray] = {}
    try:
        for tensor in request.inputs:
            if tensor.name in placeholders or tensor.HasField("contents"):
                return None
            shape, dtype = input_spec(tensor)
            if dtype is None:  # BYTES
                return None
            placeholders[tensor.name] = placeholder(shape, dtype)
        return placeholders, output_names(request)
    except (InputError, RefusedError):
        return None


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_infer_request(data: bytes) -> tuple[pb.ModelInferRequest, list[memoryview]]:
    """The request without its raw input contents, and those contents as views of ``data``.

    Raises:
        InputError: ``data`` is not a well-formed message.
    """
    view = memoryview(data)
    kept: list[tuple[int, int]] = []
    raw: list[memoryview] = []
    pos = 0
    while pos < len(view):
        start = pos
        field, wire, value, pos = _field(view, pos)
        if pos > len(view):
            if wire == 2:
                raise InputError("the ModelInferRequest message is malformed (a field runs past its end)")
            break
        if field == _RAW_INPUT_FIELD and wire == 2:
            raw.append(view[value:pos])
        elif kept and kept[-1][1] == start:
            kept[-1] = (kept[-1][0], pos)
        else:
            kept.append((start, pos))
    if pos > len(view):
        raise InputError("the ModelInferRequest message is malformed (it ends inside a field)")
    rest = b"".join(view[a:b] for a, b in kept)
    try:
        return pb.ModelInferRequest.FromString(rest), raw
    except Exception as e:  # protobuf's DecodeError
        raise InputError(f"the ModelInferRequest message is malformed: {e}") from e


def encode_infer_response_parts(
    model: str, version: str, request_id: str, outputs: Mapping[str, Any]
) -> list[bytes | memoryview]:
    """A ``ModelInferResponse`` of ``outputs`` (raw contents) as parts: its small fields, then each output.

    The outputs' parts are views of their arrays: sent as they are, they are
    never joined into one message.
    """
    described = []
    for name, value in outputs.items():
        if (
            type(value) is not np.ndarray
            or value.dtype not in NUMPY_TO_TRITON
            or not value.flags.c_contiguous
        ):
            break
        described.append((name, NUMPY_TO_TRITON[value.dtype], value.shape, value.nbytes))
    else:  # host arrays of numbers: the response's small fields as before, made once per description
        head, keys = _response_head(model, version, request_id, tuple(described))
        parts: list[bytes | memoryview] = [head]
        for key, value in zip(keys, outputs.values()):
            parts.extend((key, memoryview(value.reshape(-1).view(np.uint8))))
        return parts
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    parts = []
    for blob in add_outputs(response, outputs):
        parts.extend((_RAW_OUTPUT_KEY, encode_varint(len(blob)), blob))
    return [response.SerializeToString(), *parts]


@functools.lru_cache(maxsize=1024)
def _response_head(
    model: str, version: str, request_id: str, described: tuple[tuple[str, str, tuple[int, ...], int], ...]
) -> tuple[bytes, tuple[bytes, ...]]:
    """A response's fields but its raw contents, and each raw content's key and length, by description."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    keys = []
    for name, datatype, shape, nbytes in described:
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(int(d) for d in shape)
        keys.append(_RAW_OUTPUT_KEY + encode_varint(nbytes))
    return response.SerializeToString(), tuple(keys)
