"""A client process of the client host: unmodified tritonclient against one host's endpoints.

Takes turns over its endpoints (each a protocol and ``address:port``, e.g. the
front door's gRPC port and Serve's gRPC proxy of one host), with the fault
soak's requests (:func:`~ray_triton_shm._private.cli.soak_caller.make_request`:
values no other request carries, every output value checked). Counts per
endpoint: correct, wrong, errors by kind (the fault soak's kinds, and ``connection
unreachable`` for an address that no host answers any more), and the epoch seconds of every
correct answer and of every error (for recovery times). Writes its counts as
JSON to ``--out`` every few seconds, and a last time on SIGTERM.

Example:
    python -m tests.cluster.caller --caller 3 --out /tmp/c3.json \\
        --endpoint grpc,198.18.0.1:8101 --endpoint grpc,198.18.0.1:9000,triton
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from ray_triton_shm._private.cli import soak_caller

_MAX_TIMES = 20000


def _classify(error: BaseException) -> str:
    """:func:`soak_caller.classify`, and a host that is gone (no route to it) as a connection error."""
    if isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "connection unreachable"
    return soak_caller.classify(error)


class Endpoint:
    """One endpoint and its counts."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        protocol, url, *app = spec.split(",")
        self.protocol, self.url, self.app = protocol, url, (app[0] if app else None)
        self.timeout_s = timeout_s
        self.infer: Any = None
        self.counts: dict[str, Any] = {
            "protocol": protocol,
            "url": url,
            "requests": 0,
            "correct": 0,
            "wrong": 0,
            "errors": {},
            "samples": [],
            "correct_at": [],
            "error_at": [],
        }

    def connect(self) -> None:
        if self.protocol == "http":
            self.infer = soak_caller.http_caller(self.url, self.timeout_s)
        else:
            self.infer = soak_caller.grpc_caller(self.url, self.timeout_s, self.app)

    def close(self) -> None:
        if self.infer is not None:
            self.infer.close()
            self.infer = None

    def call(self, caller: int, n: int) -> None:
        model, inputs, expected = soak_caller.make_request(caller, n)
        counts = self.counts
        counts["requests"] += 1
        try:
            if self.infer is None:
                self.connect()
            outputs = self.infer(model, inputs, list(expected))
        except Exception as e:
            kind = _classify(e)
            counts["errors"][kind] = counts["errors"].get(kind, 0) + 1
            if len(counts["error_at"]) < _MAX_TIMES:
                counts["error_at"].append(round(time.time(), 3))
            if len(counts["samples"]) < 5:
                counts["samples"].append(f"{kind}: {type(e).__name__}: {str(e)[:300]}")
            if kind.startswith("connection") or kind == "timeout":
                self.close()
            return
        problem = soak_caller.check(expected, outputs)
        if problem is None:
            counts["correct"] += 1
            if len(counts["correct_at"]) < _MAX_TIMES:
                counts["correct_at"].append(round(time.time(), 3))
        else:
            counts["wrong"] += 1
            if len(counts["samples"]) < 5:
                counts["samples"].append(f"wrong: {model} request {n}: {problem}")


def main(argv: Sequence[str] | None = None) -> int:
    """Call the endpoints in turn until SIGTERM; write the counts to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caller", type=int, required=True, help="index in [0, 200): tags its values")
    parser.add_argument("--endpoint", action="append", required=True, help="protocol,host:port[,app]")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between requests")
    parser.add_argument("--out", required=True, help="the counts (rewritten every --every seconds)")
    parser.add_argument("--every", type=float, default=2.0)
    args = parser.parse_args(argv)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    endpoints = [Endpoint(spec, args.timeout) for spec in args.endpoint]
    n = 0
    written = time.monotonic()
    while not stopping:
        for endpoint in endpoints:
            n += 1
            endpoint.call(args.caller, n)
            if stopping:
                break
            time.sleep(args.pause)
        if time.monotonic() - written > args.every:
            _write(args.out, args.caller, endpoints, done=False)
            written = time.monotonic()
    for endpoint in endpoints:
        endpoint.close()
    _write(args.out, args.caller, endpoints, done=True)
    return 0


def _write(path: str, caller: int, endpoints: list[Endpoint], done: bool) -> None:
    """The counts so far, replaced at once (a reader never sees half a file)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump({"caller": caller, "done": done, "endpoints": [e.counts for e in endpoints]}, f)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    sys.exit(main())
