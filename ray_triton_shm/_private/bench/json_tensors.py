"""JSON tensors read and written by the C extension against the json module, in one process.

For FP32 tensors of a few sizes, as ``tritonclient.http`` sends them as JSON
(``tolist()`` of the array: the shortest text of each value widened to a
double), the time and traced peak memory of
:func:`~ray_triton_shm._private.serve.protocol.kserve.decode_request` and of
:func:`~ray_triton_shm._private.serve.protocol.kserve.encode_response` with a
JSON output: once with the C reader and writer (``_kserve_json``), once with the
json module (the extension set aside). Each time is the fastest of ``--repeat``
untraced runs, the two ways alternating; the ratio is the json module's time over
the extension's; the peak (``tracemalloc``) is taken in one more run of each.

Run::

    python -m ray_triton_shm._private.bench.json_tensors --sizes 64K,1M,4M --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ray_triton_shm._private.bench.options import parse_sizes
from ray_triton_shm._private.serve.protocol import kserve, kserve_json


@contextlib.contextmanager
def _json_module_only() -> Iterator[None]:
    """The extension set aside: every reading and writing goes the json module's way."""
    saved = kserve_json._kserve_json
    kserve_json._kserve_json = None
    try:
        yield
    finally:
        kserve_json._kserve_json = saved


def _seconds(call: Callable[[], Any]) -> float:
    """Seconds one ``call()`` takes (untraced)."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _peak_bytes(call: Callable[[], Any]) -> int:
    """Traced peak memory of one ``call()`` (tracing slows it: timed apart)."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(nbytes: int, repeat: int) -> list[dict[str, Any]]:
    """The table's rows (decode, encode) for an FP32 tensor of ``nbytes`` bytes.

    Raises:
        RuntimeError: The extension is not built (nothing to compare).
    """
    if not kserve_json.available():
        raise RuntimeError("the _kserve_json extension is not built: pip install -e . with a C compiler")
    values = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [1, values.size], "data": values.tolist()}
    body = json.dumps({"inputs": [tensor]}).encode()
    request = kserve.decode_request(body, None)
    outputs = {"OUTPUT0": values.reshape(1, -1)}
    steps = {
        "decode_request": lambda: kserve.decode_request(body, None),
        "encode_response": lambda: kserve.encode_response("identity", request, outputs),
    }
    rows = []
    for step, call in steps.items():
        seconds: dict[str, float] = {}
        peaks: dict[str, int] = {}
        for run in range(repeat + 1):
            for way in ("c", "json"):
                with _json_module_only() if way == "json" else contextlib.nullcontext():
                    if run == repeat:
                        peaks[way] = _peak_bytes(call)
                    else:
                        seconds[way] = min(_seconds(call), seconds.get(way, float("inf")))
        rows.append(
            {
                "tensor MB": round(nbytes / 1e6, 2),
                "JSON MiB": round(len(body) / 2**20, 1),
                "step": step,
                "C ms": round(seconds["c"] * 1e3, 1),
                "json module ms": round(seconds["json"] * 1e3, 1),
                "json module / C": round(seconds["json"] / seconds["c"], 1),
                "C peak MiB": round(peaks["c"] / 2**20, 1),
                "json module peak MiB": round(peaks["json"] / 2**20, 1),
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,1M,4M", help="tensor sizes in bytes (K and M suffixes)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each way; the fastest counts")
    args = parser.parse_args(argv)
    rows = [row for size in parse_sizes(args.sizes) for row in measure(size, args.repeat)]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
