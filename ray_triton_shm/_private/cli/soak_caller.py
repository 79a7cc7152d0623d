"""One external caller of the fault soak: unmodified tritonclient, every output value checked.

Runs as its own process (no Ray, nothing of this package beyond this file), the way a
web backend or a batch job calls a model server. Each request carries values no
other request of the run carries (the caller's index and a counter), alternating
``add_sub`` (``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1``) and
``identity`` (random float32 of varying size). Every answer is one of:

* ``correct``: every output value is what the request asked for;
* ``wrong``: any other answer (a wrong value, shape, type or a missing output);
* a typed error: an error answer in Triton's shape (HTTP status with a JSON
  ``{"error": ...}`` body, or a gRPC status with a message), counted by status;
* a connection error (refused, reset, timed out): no answer, counted by kind;
* ``untyped``: an error answer not in Triton's shape (a body that is not the
  KServe error object, an empty message, Ray's internals or a traceback).

After an error the caller backs off briefly and goes on. On SIGTERM (or at
``--until``) it finishes the request in flight and writes its counts as JSON.

Example::

    python -m ray_triton_shm._private.cli.soak_caller --protocol grpc --url 127.0.0.1:9000 \\
        --caller 3 --out /tmp/caller-3.json
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

_WIDTH = 16
_TAG_STRIDE = 10_000_000
"""Tags of caller ``i`` are ``i * _TAG_STRIDE + n``: unique across callers and within int32."""
_IDENTITY_SIZES = (256, 16_384, 262_144)
"""Elements of the ``identity`` requests, taken in turn (1 KB, 64 KB, 1 MB)."""
_MAX_EVENTS = 5000
_MAX_SAMPLES = 5
# Ray's words in an error answer: its exception names, actor table and worker exit details.
_RAY_INTERNALS = (
    "Traceback (most recent call last)",
    "ray.exceptions",
    "RayTaskError",
    "ActorDiedError",
    "The actor died",
    "actor_id:",
    "Worker exit type",
)
# What gRPC itself says (not the server) when it cannot connect, or the connection broke.
_GRPC_CONNECT = ("failed to connect", "connection refused")
_GRPC_RESET = ("socket closed", "connection reset", "stream removed", "broken pipe", "recvmsg", "goaway")

Request = tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]
"""Model, inputs, and the outputs expected."""


def make_request(caller: int, n: int) -> Request:
    """Request ``n`` of ``caller``: its inputs and exactly what must come back."""
    tag = caller * _TAG_STRIDE + n
    rng = np.random.default_rng(tag)
    if n % 2:
        first = (tag + np.arange(_WIDTH, dtype=np.int32)).reshape(1, _WIDTH)
        second = rng.integers(-(2**20), 2**20, (1, _WIDTH), dtype=np.int32)
        return (
            "add_sub",
            {"INPUT0": first, "INPUT1": second},
            {"OUTPUT0": first + second, "OUTPUT1": first - second},
        )
    size = _IDENTITY_SIZES[(n // 2) % len(_IDENTITY_SIZES)]
    values = rng.standard_normal((1, size), dtype=np.float32)
    values[0, 0] = np.float32(tag)
    return "identity", {"INPUT0": values}, {"OUTPUT0": values}


def check(expected: dict[str, np.ndarray], outputs: dict[str, Any]) -> str | None:
    """Why ``outputs`` are not ``expected`` (None when every value, shape and type matches)."""
    for name, want in expected.items():
        got = outputs.get(name)
        if got is None:
            return f"{name} missing"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name} is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
        if not np.array_equal(got, want):
            bad = int(np.count_nonzero(got != want))
            return f"{name}: {bad} of {want.size} values differ"
    return None


def classify(error: BaseException) -> str:
    """The class of a failed request: a typed error by status, a connection error, or ``untyped``."""
    if isinstance(error, InferenceServerException):
        status = str(error.status() or "")
        message = str(error.message() or "")
        if status.startswith("StatusCode."):
            code = status.removeprefix("StatusCode.")
            lowered = message.lower()
            if code == "DEADLINE_EXCEEDED":
                return "timeout"
            # gRPC's own transport messages start with their cause; a server's answer
            # (ours: "[UNAVAILABLE] cannot reach Triton ...") has its own words first.
            if code == "UNAVAILABLE" and lowered.startswith(_GRPC_CONNECT):
                return "connection refused"
            if code == "UNAVAILABLE" and lowered.startswith(_GRPC_RESET):
                return "connection reset"
            if not message or code == "UNKNOWN" or any(w in message for w in _RAY_INTERNALS):
                return f"untyped grpc {code}"
            return f"grpc {code}"
        if status.isdigit():
            # tritonclient read a JSON {"error": ...} body, or says it could not.
            if (
                not message
                or message.startswith("an exception occurred in the client while decoding")
                or message == "client received an empty response from the server."
                or message.startswith("internal error (")  # the ingress's catch-all: a bug
                or any(w in message for w in _RAY_INTERNALS)
            ):
                return f"untyped http {status}"
            return f"http {status}"
        if "timed out" in message.lower() or "deadline" in message.lower():
            return "timeout"
        return f"untyped {type(error).__name__}"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "connection reset"
    if type(error).__name__ == "HTTPConnectionClosed":  # geventhttpclient: closed before any answer
        return "connection reset"
    if isinstance(error, TimeoutError) or type(error).__name__ in ("Timeout", "ConnectionTimeout"):
        return "timeout"
    if isinstance(error, OSError) and "timed out" in str(error).lower():
        return "timeout"
    return f"untyped {type(error).__name__}"


def http_caller(url: str, timeout_s: float) -> Callable[[str, dict[str, np.ndarray], Sequence[str]], Any]:
    client = httpclient.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)

    def infer(model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, Any]:
        request = []
        for name, array in inputs.items():
            tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array, binary_data=True)
            request.append(tensor)
        wanted = [httpclient.InferRequestedOutput(name, binary_data=True) for name in outputs]
        result = client.infer(model, request, outputs=wanted)
        return {name: result.as_numpy(name) for name in outputs}

    infer.close = client.close  # type: ignore[attr-defined]
    return infer


def grpc_caller(
    url: str, timeout_s: float, app: str | None
) -> Callable[[str, dict[str, np.ndarray], Sequence[str]], Any]:
    client = grpcclient.InferenceServerClient(url)
    headers = {"application": app} if app else None

    def infer(model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, Any]:
        request = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            request.append(tensor)
        wanted = [grpcclient.InferRequestedOutput(name) for name in outputs]
        result = client.infer(model, request, outputs=wanted, headers=headers, client_timeout=timeout_s)
        return {name: result.as_numpy(name) for name in outputs}

    infer.close = client.close  # type: ignore[attr-defined]
    return infer


class _Counts:
    def __init__(self, caller: int, protocol: str) -> None:
        self.caller, self.protocol = caller, protocol
        self.requests = self.correct = self.wrong = 0
        self.errors: dict[str, int] = {}
        self.samples: dict[str, list[str]] = {}
        self.correct_by_second: dict[int, int] = {}
        self.events: list[tuple[float, str]] = []
        self.latencies_ms: list[float] = []

    def note(self, kind: str, detail: str, at: float) -> None:
        shown = self.samples.setdefault(kind, [])
        if len(shown) < _MAX_SAMPLES:
            shown.append(detail[:600])
        if len(self.events) < _MAX_EVENTS:
            self.events.append((round(at, 3), kind))

    def as_json(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.asarray([np.nan])
        return {
            "caller": self.caller,
            "protocol": self.protocol,
            "requests": self.requests,
            "correct": self.correct,
            "wrong": self.wrong,
            "errors": self.errors,
            "samples": self.samples,
            "correct_by_second": {str(k): v for k, v in sorted(self.correct_by_second.items())},
            "events": self.events,
            "p50_ms": float(np.nanpercentile(lat, 50)),
            "p99_ms": float(np.nanpercentile(lat, 99)),
        }


def run(
    protocol: str, url: str, caller: int, until: float, timeout_s: float = 30.0, app: str | None = None
) -> dict[str, Any]:
    """Call until ``until`` (epoch seconds) or SIGTERM; return the counts (see the module docstring)."""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    counts = _Counts(caller, protocol)

    def connect() -> Callable[[str, dict[str, np.ndarray], Sequence[str]], Any]:
        return http_caller(url, timeout_s) if protocol == "http" else grpc_caller(url, timeout_s, app)

    infer = connect()
    failures_in_a_row = 0
    n = 0
    while not stopping and time.time() < until:
        n += 1
        model, inputs, expected = make_request(caller, n)
        started = time.perf_counter()
        counts.requests += 1
        try:
            outputs = infer(model, inputs, list(expected))
        except Exception as e:
            kind = classify(e)
            counts.errors[kind] = counts.errors.get(kind, 0) + 1
            counts.note(kind, f"{type(e).__name__}: {e}", time.time())
            failures_in_a_row += 1
            if kind.startswith("connection") or kind == "timeout":
                infer.close()  # type: ignore[attr-defined]
                infer = connect()
            time.sleep(min(0.05 * 2 ** min(failures_in_a_row, 5), 1.0))
            continue
        failures_in_a_row = 0
        problem = check(expected, outputs)
        if problem is None:
            counts.correct += 1
            counts.latencies_ms.append((time.perf_counter() - started) * 1e3)
            second = int(time.time())
            counts.correct_by_second[second] = counts.correct_by_second.get(second, 0) + 1
        else:
            counts.wrong += 1
            counts.note("wrong", f"{model} request {n}: {problem}", time.time())
    infer.close()  # type: ignore[attr-defined]
    return counts.as_json()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one caller; write its counts as JSON to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("http", "grpc"), required=True)
    parser.add_argument("--url", required=True, help="host:port (HTTP: plus the route prefix)")
    parser.add_argument("--caller", type=int, required=True, help="this caller's index (tags its values)")
    parser.add_argument("--until", type=float, default=float("inf"), help="stop at this epoch time")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--app", default=None, help="gRPC 'application' header (Serve's app name)")
    parser.add_argument("--out", required=True, help="where the JSON counts go")
    args = parser.parse_args(argv)
    if not 0 <= args.caller < 200:
        parser.error("--caller must be in [0, 200): tags must stay unique within int32")
    result = run(args.protocol, args.url, args.caller, args.until, args.timeout, args.app)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
