"""A client's requests to Triton: tensors in registered regions (shm), or serialised (plain gRPC)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.shm.bytes_tensor import serialized_size
from ray_triton_shm._private.shm.cuda import import_cupy
from ray_triton_shm._private.shm.layout import NUMPY_TO_TRITON, ModelLayout
from ray_triton_shm._private.shm.lease import Lease
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import check_span
from ray_triton_shm._private.shm.validate import CheckedInputs, bytes_nbytes
from ray_triton_shm._private.triton.call_errors import IN_DOUBT_STATUSES, region_unknown, translate_error
from ray_triton_shm._private.triton.grpc_channel import GrpcClient
from ray_triton_shm._private.triton.http_infer import HttpShmSender, ShmInput, ShmOutput, check_datatype
from ray_triton_shm._private.triton.observe import Observer, safely
from ray_triton_shm.errors import InputError, TritonCallError

_DESCRIBED = 1024  # descriptions kept (the cache starts again past this)


@dataclass(frozen=True)
class ShmRequest:
    """A shared-memory request begun on a lease (see :meth:`TritonRequests.begin_shm`)."""

    lease: Lease
    model: str
    inputs: tuple[ShmInput, ...]
    outputs: tuple[ShmOutput, ...]
    nbytes_in: int
    started: float


class TritonRequests:
    """Builds, sends and accounts for one client's inference requests.

    Args:
        grpc: The client's gRPC connection (plain gRPC requests, and shm
            requests when ``http`` is ``None``).
        http: Sends shm requests over HTTP instead, when set.
        request_timeout_s: Client-side timeout of a gRPC request.
        observer: Told about every request and error.
        reregister: Registers a pool again after the server lost it (from the
            pool source), or ``None`` when the source cannot.
        verify_layout: Raises :class:`LayoutMismatchError` if the server runs
            another model configuration than a layout's.
    """

    def __init__(
        self,
        grpc: GrpcClient,
        http: HttpShmSender | None,
        request_timeout_s: float | None,
        observer: Observer,
        reregister: Callable[[SlotPool], None] | None,
        verify_layout: Callable[[ModelLayout], None],
    ) -> None:
        self._grpc = grpc
        self._http = http
        self._timeout = request_timeout_s
        self._observer = observer
        self._reregister = reregister
        self._verify_layout = verify_layout
        # A request's checked description, by slot and shapes (requests repeat: checked once each).
        self._described: dict[tuple, tuple[Any, ...]] = {}

    def call_shm(
        self,
        lease: Lease,
        shapes: Mapping[str, tuple[int, ...]],
        wanted: Sequence[str] | None,
    ) -> dict[str, tuple[int, ...]]:
        """Run the model on the inputs in ``lease``'s slot (of ``shapes``); returns the output shapes.

        Outputs are written in place into the slot; ``wanted=None`` asks for all of them.

        Raises:
            InputError: A BYTES input was not written with ``write_input``, an input
                outgrows its slot, or an output name is unknown.
            SharedMemoryError: A tensor's span would run past the region (refused locally).
            LayoutMismatchError: The server refused and runs another model configuration.
            TritonCallError: The server refused the request.
        """
        request = self.begin_shm(lease, shapes, wanted)
        for attempt in (0, 1):
            try:
                shapes_out = self.send_shm(request.model, request.inputs, request.outputs)
            except TritonCallError as error:
                if self._failed(request, error, retry=attempt == 0):
                    request.lease.request_started(self._timeout)
                    continue
                raise
            except BaseException:
                request.lease.request_ended()
                raise
            break
        return self._succeeded(request, shapes_out)

    def begin_shm(
        self,
        lease: Lease,
        shapes: Mapping[str, tuple[int, ...]],
        wanted: Sequence[str] | None,
    ) -> ShmRequest:
        """The first half of :meth:`call_shm`: the request, checked and marked as sent on the lease.

        Whoever sends it ends it with :meth:`finish_shm` (or as :meth:`call_shm` does).

        Raises:
            As :meth:`call_shm`, for what is refused before anything is sent.
        """
        layout = lease.layout
        region, base, size = lease.region_name, lease.offset, lease.pool.region_bytes
        key = None
        if not any(spec.is_bytes for spec in layout.inputs):  # a BYTES input's size is the lease's
            key = (id(layout), region, base, size, tuple(tuple(shapes[spec.name]) for spec in layout.inputs))
            key += (None if wanted is None else tuple(wanted),)
            described = self._described.get(key)
            if described is not None and described[0] is layout:
                lease.flush()
                request = ShmRequest(lease, layout.model, *described[1:], time.perf_counter())
                lease.request_started(self._timeout)
                return request
        inputs = []
        nbytes_in = 0
        for spec in layout.inputs:
            shape = tuple(shapes[spec.name])
            if spec.is_bytes:
                if spec.name not in lease.input_nbytes:
                    raise InputError(f"{spec.name}: a BYTES input must be written with write_input")
                nbytes = lease.input_nbytes[spec.name]  # Triton's serialised size, exactly
            else:
                nbytes = math.prod(shape) * spec.dtype.itemsize
            if nbytes > spec.capacity:
                raise InputError(f"{spec.name}: {nbytes} bytes do not fit its {spec.capacity} byte slot")
            check_span(region, size, base + spec.offset, nbytes)
            inputs.append(ShmInput(spec.name, shape, spec.datatype, region, nbytes, base + spec.offset))
            nbytes_in += nbytes
        names = list(wanted) if wanted is not None else [spec.name for spec in layout.outputs]
        outputs = []
        for name in names:
            spec = layout.output(name)
            if spec is None:
                raise InputError(f"model {layout.model!r} has no output {name!r}")
            check_span(region, size, base + spec.offset, spec.capacity)
            outputs.append(ShmOutput(name, region, spec.capacity, base + spec.offset, spec.datatype))
        if key is not None:
            if len(self._described) >= _DESCRIBED:
                self._described.clear()
            self._described[key] = (layout, tuple(inputs), tuple(outputs), nbytes_in)
        lease.flush()
        request = ShmRequest(
            lease, layout.model, tuple(inputs), tuple(outputs), nbytes_in, time.perf_counter()
        )
        lease.request_started(self._timeout)  # if we die now, the slot waits out this deadline
        return request

    @property
    def over_http(self) -> bool:
        """Whether shm requests go to Triton's HTTP endpoint (and :meth:`wire_request` gives their bytes)."""
        return self._http is not None

    def wire_request(self, request: ShmRequest) -> tuple[str, bytes, float | None] | None:
        """``request`` as the bytes to post to Triton's HTTP endpoint (its address, the bytes and
        the answer's timeout), or ``None`` where shm requests go over gRPC."""
        if self._http is None:
            return None
        return (
            self._http.url,
            self._http.request_bytes(request.model, request.inputs, request.outputs),
            self._timeout,
        )

    def finish_shm(
        self, request: ShmRequest, code: int, body: bytes, retry: bool
    ) -> dict[str, tuple[int, ...]] | None:
        """The second half of :meth:`call_shm`, given Triton's answer to :meth:`wire_request`'s bytes.

        ``code`` is the HTTP status (``-1``: no answer within the timeout, ``-2``: Triton could
        not be reached or answered unreadably, ``body`` saying why). Returns the output shapes,
        or ``None`` when the request must be sent once more (the pool was registered again:
        only if ``retry``).

        Raises:
            As :meth:`call_shm`.
        """
        try:
            shapes_out = self._http.answer(request.model, request.outputs, code, body)  # type: ignore[union-attr]
        except TritonCallError as error:
            if self._failed(request, error, retry):
                request.lease.request_started(self._timeout)
                return None
            raise
        return self._succeeded(request, shapes_out)

    def _failed(self, request: ShmRequest, error: TritonCallError, retry: bool) -> bool:
        """Account for a refused request; whether to send it again (its pool registered again)."""
        lease = request.lease
        lease.request_ended()
        if error.status in IN_DOUBT_STATUSES:
            lease.mark_in_doubt()
        # A restarted server has forgotten our region: register it again, once.
        if retry and self._reregister is not None and region_unknown(error):
            self._reregister(lease.pool)
            return True
        safely(self._observer.error, request.model, type(error).__name__)
        if error.status == "INVALID_ARGUMENT":
            self._verify_layout(lease.layout)  # a reloaded model: a typed error, not a puzzle
        return False

    def _succeeded(
        self, request: ShmRequest, shapes_out: dict[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        lease = request.lease
        lease.request_ended()
        seconds = time.perf_counter() - request.started
        nbytes = request.nbytes_in + sum(
            _output_nbytes(lease, name, shape) for name, shape in shapes_out.items()
        )
        path = "cuda_shm" if lease.pool.memory == "cuda" else "shm"
        safely(self._observer.request, request.model, path, nbytes, seconds)
        return shapes_out

    def send_shm(
        self, model: str, inputs: Sequence[ShmInput], outputs: Sequence[ShmOutput]
    ) -> dict[str, tuple[int, ...]]:
        """One request whose tensors all lie in registered regions; returns the output shapes.

        Raises:
            TritonCallError: The server refused, or answered with outputs other than asked for.
        """
        if self._http is not None:
            return self._http.infer(model, inputs, outputs)
        request_inputs = []
        for t in inputs:
            tensor = grpcclient.InferInput(t.name, list(t.shape), t.datatype)
            tensor.set_shared_memory(t.region, t.byte_size, offset=t.offset)
            request_inputs.append(tensor)
        request_outputs = []
        for t in outputs:
            tensor = grpcclient.InferRequestedOutput(t.name)
            tensor.set_shared_memory(t.region, t.byte_size, offset=t.offset)
            request_outputs.append(tensor)
        try:
            response = self._grpc.infer(
                model, request_inputs, outputs=request_outputs, client_timeout=self._timeout
            )
        except InferenceServerException as e:
            raise translate_error(e, model) from e
        shapes = {}
        for t in outputs:
            out = response.get_output(t.name)
            if out is None:
                raise TritonCallError(f"server returned no output {t.name!r}", None, model)
            check_datatype(t, out.datatype, model)  # another config than the layout's: not our bytes
            shapes[t.name] = tuple(int(d) for d in out.shape)
        return shapes

    def call_grpc(self, model: str, checked: CheckedInputs, wanted: list[str]) -> dict[str, np.ndarray]:
        """Run ``model`` with its tensors serialised into the request (no slots); returns the outputs.

        Raises:
            TritonCallError: The server refused the request.
        """
        request_inputs = []
        for name, array in checked.arrays.items():
            if not isinstance(array, np.ndarray):  # a cupy array: plain gRPC sends host bytes
                array = import_cupy().asnumpy(array)
            datatype = "BYTES" if array.dtype == object else NUMPY_TO_TRITON[array.dtype]
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(np.ascontiguousarray(array))
            request_inputs.append(tensor)
        request_outputs = [grpcclient.InferRequestedOutput(name) for name in wanted]
        started = time.perf_counter()
        try:
            response = self._grpc.infer(
                model,
                request_inputs,
                outputs=request_outputs,
                client_timeout=self._timeout,
            )
        except InferenceServerException as e:
            error = translate_error(e, model)
            safely(self._observer.error, model, type(error).__name__)
            raise error from e
        seconds = time.perf_counter() - started
        outputs = {name: response.as_numpy(name) for name in wanted}
        nbytes = checked.nbytes + sum(
            bytes_nbytes(a) if a.dtype == object else a.nbytes for a in outputs.values()
        )
        safely(self._observer.request, model, "grpc", nbytes, seconds)
        return outputs


def _output_nbytes(lease: Lease, name: str, shape: tuple[int, ...]) -> int:
    """Bytes Triton wrote for output ``name`` (a BYTES output's serialised size)."""
    spec = lease.layout.output(name)
    if spec.is_bytes:
        return serialized_size(lease.slot.arrays[name], math.prod(shape))
    return math.prod(shape) * spec.dtype.itemsize
