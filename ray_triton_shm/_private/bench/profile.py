"""Where a request's time goes: the client's clock against Triton's own statistics.

For one caller and a few payload sizes, each method runs ``calls`` timed calls
between two snapshots of Triton's statistics of the model (``/v2/models/<m>/stats``).
Per request, on average:

* ``total``: the caller's clock around one call (our copies included);
* ``server``: Triton's time from receiving the request to its response being
  complete (``success``), split into ``queue``, ``input`` (the backend getting its
  input and output buffers: through shared memory, the server's mappings of
  our regions), ``backend`` (the model itself: the identity's one memcpy) and
  ``output`` (the response handed back to the frontend);
* ``client + transport``: ``total - server``: the client's own work (copies,
  request building, our HTTP client or gRPC), and the bytes on the socket.

``memcpy`` is numpy copying the payload once, the floor a copy costs here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from ray_triton_shm._private.bench.core_methods import CORE_METHODS, Endpoints, make_inputs

KB = 1024
MB = 1024 * KB
PROFILE_SIZES = (4 * KB, 16 * MB, 128 * MB)
PROFILE_METHODS = ("grpc", "http", "triton-shm-client", "ours-copy", "ours-views", "ours-inplace")
_STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def _stats(grpc_url: str, model: str) -> dict[str, tuple[int, int]]:
    """``{stage: (count, ns)}`` of ``model``'s inference statistics, success included."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        stats = client.get_inference_statistics(model_name=model, as_json=True)
    inference = stats["model_stats"][0]["inference_stats"]
    return {
        stage: (int(inference.get(stage, {}).get("count", 0)), int(inference.get(stage, {}).get("ns", 0)))
        for stage in ("success", *_STAGES)
    }


def _memcpy_ms(x: np.ndarray, calls: int) -> float:
    dst = np.empty_like(x)
    np.copyto(dst, x)
    began = time.perf_counter()
    for _ in range(calls):
        np.copyto(dst, x)
    return (time.perf_counter() - began) / calls * 1e3


def profile_requests(
    endpoints: Endpoints, sizes: Sequence[int], methods: Sequence[str], calls: int = 12
) -> list[dict[str, Any]]:
    """One row per (size, method): mean ms per request of each part (see the module doc).

    Raises:
        KeyError: The server has no statistics for ``endpoints.model``.
    """
    rows: list[dict[str, Any]] = []
    for size in sizes:
        inputs = make_inputs(size, 1, seed=3)
        memcpy_ms = _memcpy_ms(inputs[0], max(3, calls))
        for method in methods:
            cell = None
            try:
                cell = CORE_METHODS[method](endpoints, inputs)
                call = cell.callers[0]
                call(True)
                call(False)
                before = _stats(endpoints.grpc_url, endpoints.model)
                began = time.perf_counter()
                for _ in range(calls):
                    call(False)
                total_ms = (time.perf_counter() - began) / calls * 1e3
                after = _stats(endpoints.grpc_url, endpoints.model)
            except Exception as e:
                rows.append({"method": method, "payload_bytes": size, "error": f"{type(e).__name__}: {e}"})
                continue
            finally:
                if cell is not None:
                    cell.close()
            count = after["success"][0] - before["success"][0]
            row: dict[str, Any] = {"method": method, "payload_bytes": size, "calls": calls, "requests": count}
            if count <= 0:
                row["error"] = "the server counted no request (the method did not reach it)"
                rows.append(row)
                continue

            def per_request(stage: str, now: dict = after, then: dict = before, n: int = count) -> float:
                return (now[stage][1] - then[stage][1]) / n / 1e6

            server_ms = per_request("success")
            row.update(
                total_ms=total_ms,
                server_ms=server_ms,
                queue_ms=per_request("queue"),
                input_ms=per_request("compute_input"),
                backend_ms=per_request("compute_infer"),
                output_ms=per_request("compute_output"),
                client_transport_ms=total_ms * calls / count - server_ms,
                memcpy_ms=memcpy_ms,
            )
            rows.append(row)
    return rows
