"""What a gRPC call of 1 MB costs the servers, six ways, with one kind of caller in one run.

The paths, taking turns each round:

* ``prototype``: ``proto_h2`` (``proto_h2.c`` here, built with ``cc`` on first use), a
  measurement prototype of the front door's per-call work in C, one thread per connection:
  HTTP/2 frames, the request tensor read straight into a shared-memory slot, the
  shared-memory request to Triton over HTTP, the answer written from the slot. It decodes
  no headers (every stream is taken as ``ModelInfer``), keeps no limits and is no server to
  ship: it measures the floor of that work. It uses a Triton of its own (the same native
  models).
* ``prototype-nghttp2``: ``proto_nghttp2`` (``proto_nghttp2.c``), the same work with nghttp2
  keeping the HTTP/2 side (frames, HPACK both ways, flow control, SETTINGS and PING): each
  DATA payload copied from the read buffer into the slot, the answer's bytes sent from the
  slot, every frame of a send round in one ``writev``.
* ``prototype-nghttp2-zc``: the same, the DATA payloads that reach past the read buffer read
  from the socket straight into the slot.
* ``prototype-triton``: the prototypes' Triton's own gRPC endpoint.
* ``frontdoor``: the front door's gRPC port of a Serve app (2 replicas, native server).
* ``triton``: the app's node Triton's own gRPC endpoint.

The callers (``--caller``): ``h2load -c CONNS -m STREAMS -n CALLS`` posting one ``ModelInfer``
message (an ``identity`` request of 262,144 FP32) with windows of 1 GiB (``h2load``, of
nghttp2, sends DATA frames of 16 KB, as Go and Java clients do), or ``CONNS`` tritonclient
(grpcio) processes calling one at a time (grpc-core sends frames as large as the server
allows, and its own WINDOW_UPDATE and PING frames). Every path's answers are first checked
with ``tritonclient``. Server CPU per call: ``utime + stime`` from ``/proc`` of the path's
processes (a prototype and its Triton; the replicas, the node actor and the node's
Triton; Triton alone) around the run, over the calls it made.

Needs ``make native``, Debian's ``nghttp2-client`` and ``libnghttp2-dev`` (nghttp2's headers).
Run from the repository root::

    .venv/bin/python tools/grpc_c_floor/measure.py --rounds 4 --calls 3000
    .venv/bin/python tools/grpc_c_floor/measure.py --caller grpcio --rounds 4 --calls 2000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.service_pb2 as pb

from ray_triton_shm import ServerConfig, TritonServer
from ray_triton_shm._private.bench.attacks.judge import listening_pids
from ray_triton_shm._private.bench.frontdoor import _Setup
from ray_triton_shm._private.triton.server_launch import free_ports

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
SLOTS, SLOT_BYTES = 16, 4 << 20
ELEMENTS = 262_144  # 1 MiB of FP32


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (its threads that ended included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def grpc_message(model: str) -> bytes:
    """One gRPC-framed ``ModelInfer`` request of ``model``'s ``INPUT0``, ``ELEMENTS`` FP32."""
    x = np.random.default_rng(0).random(ELEMENTS, dtype=np.float32)
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "FP32"
    tensor.shape.extend([1, x.size])
    request.raw_input_contents.append(x.tobytes())
    body = request.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def check_answers(port: int, model: str) -> None:
    """Three calls through tritonclient, each answer compared with its input."""
    x = np.random.default_rng(1).random(ELEMENTS, dtype=np.float32).reshape(1, -1)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        for _ in range(3):
            got = client.infer(model, [tensor]).as_numpy("OUTPUT0")
            if not np.array_equal(got, x):
                raise SystemExit(f"a wrong answer on port {port}")


def _in_children(run: Callable[[], T]) -> tuple[T, float, float]:
    """``run()``'s result, its seconds, and the CPU seconds of the child processes it waited for."""
    before = os.times()
    started = time.monotonic()
    result = run()
    wall = time.monotonic() - started
    after = os.times()
    return (
        result,
        wall,
        after.children_user + after.children_system - before.children_user - before.children_system,
    )


def h2load(port: int, data: Path, args: argparse.Namespace) -> tuple[int, float, float, str]:
    """(calls answered 2xx, seconds, h2load's own CPU seconds, its summary line) of one run."""
    command = [
        "h2load",
        *("-c", str(args.conns), "-m", str(args.streams), "-n", str(args.calls)),
        *("-w", "30", "-W", "30", "-d", str(data)),
        *("-H", "content-type: application/grpc", "-H", "te: trailers"),
        f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer",
    ]
    out, wall, caller = _in_children(
        lambda: subprocess.run(command, capture_output=True, text=True, check=False).stdout
    )
    codes = next((line for line in out.splitlines() if line.startswith("status codes:")), "")
    ok = int(codes.split()[2]) if codes else 0
    summary = next((line for line in out.splitlines() if line.startswith("requests:")), out[-200:])
    return ok, wall, caller, summary


_GRPCIO_CALLER = """
import sys, numpy as np, tritonclient.grpc as g
port, model, calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
x = np.random.default_rng(2).random((1, {elements}), dtype=np.float32)
t = g.InferInput("INPUT0", list(x.shape), "FP32")
t.set_data_from_numpy(x)
with g.InferenceServerClient(f"127.0.0.1:{{port}}") as client:
    ok = sum(client.infer(model, [t]).as_numpy("OUTPUT0") is not None for _ in range(calls))
print(ok)
"""


def grpcio(port: int, model: str, args: argparse.Namespace) -> tuple[int, float, float, str]:
    """As :func:`h2load`, with ``args.conns`` tritonclient (grpcio) processes calling one at a time.

    grpc-core sends a message in DATA frames as large as the server allows, where h2load sends
    16 KB frames.
    """
    code = _GRPCIO_CALLER.format(elements=ELEMENTS)
    each = args.calls // args.conns
    command = [sys.executable, "-c", code, str(port), model, str(each)]

    def run() -> int:
        callers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(args.conns)]
        return sum(int(p.communicate()[0].strip() or 0) for p in callers)

    ok, wall, caller = _in_children(run)
    return ok, wall, caller, f"{args.conns} tritonclient.grpc callers, {ok} calls"


def build_prototype(name: str, libraries: tuple[str, ...] = ()) -> Path:
    binary = HERE / name
    source = HERE / f"{name}.c"
    newest = max(source.stat().st_mtime, (HERE / "proto_common.h").stat().st_mtime)
    if not binary.exists() or binary.stat().st_mtime < newest:
        command = ["cc", "-O2", "-Wall", "-o", str(binary), str(source), *libraries, "-lpthread"]
        subprocess.run(command, check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--caller",
        choices=("h2load", "grpcio"),
        default="h2load",
        help="h2load (16 KB DATA frames) or tritonclient.grpc processes, one per connection",
    )
    args = parser.parse_args()
    binaries = (build_prototype("proto_h2"), build_prototype("proto_nghttp2", ("-lnghttp2",)))
    work = Path(tempfile.mkdtemp(prefix="grpc-c-floor-"))
    app = _Setup("plain", ("native",), 4 << 20, 2, work)
    app.start()
    try:
        fd_grpc = int(app.urls["frontdoor-grpc"][0].rsplit(":", 1)[1])
        fd_http = int(app.urls["frontdoor-http"][0].rsplit(":", 1)[1])
        node_grpc = int(app.urls["triton-grpc"][0].rsplit(":", 1)[1])
        time.sleep(3)
        replicas, node_triton = listening_pids(fd_http), listening_pids(node_grpc)
        with TritonServer(ServerConfig(model_repository="deployments/native_models")) as server:
            run_paths(args, binaries, server, work, fd_grpc, node_grpc, replicas, node_triton)
    finally:
        app.stop()


def run_paths(
    args: argparse.Namespace,
    binaries: tuple[Path, Path],
    server: TritonServer,
    work: Path,
    fd_grpc: int,
    node_grpc: int,
    replicas: list[int],
    node_triton: list[int],
) -> None:
    triton_grpc = int(server.grpc_url.rsplit(":", 1)[1])
    triton_http = int(server.http_url.rsplit(":", 1)[1])
    key = f"/grpc_c_floor_{os.getpid()}"
    control = grpcclient.InferenceServerClient(server.grpc_url)
    files = []
    protos: list[subprocess.Popen] = []
    try:
        for k in range(SLOTS):
            for kind in ("in", "out"):
                name = f"{key}_{kind}_{k}"
                fd = os.open(f"/dev/shm{name}", os.O_CREAT | os.O_RDWR, 0o600)
                os.ftruncate(fd, SLOT_BYTES)
                os.close(fd)
                files.append(Path(f"/dev/shm{name}"))
                control.register_system_shared_memory(
                    f"p_{kind}_{k}", name, SLOT_BYTES, headers=server.shm_api_headers
                )
        runs = [(binaries[0], ()), (binaries[1], ()), (binaries[1], ("zero-copy",))]
        ports = free_ports("127.0.0.1", len(runs))
        for (binary, extra), port in zip(runs, ports):
            slots = [key, "p", str(SLOTS), str(SLOT_BYTES)]
            command = [str(binary), str(port), str(triton_http), *slots, *extra]
            protos.append(subprocess.Popen(command))
        time.sleep(0.5)
        native, ours = work / "native.bin", work / "ours.bin"
        native.write_bytes(grpc_message("identity"))
        ours.write_bytes(grpc_message("identity_native"))
        paths = [
            ("prototype", ports[0], native, "identity", [protos[0].pid, server.pid]),
            ("prototype-nghttp2", ports[1], native, "identity", [protos[1].pid, server.pid]),
            ("prototype-nghttp2-zc", ports[2], native, "identity", [protos[2].pid, server.pid]),
            ("prototype-triton", triton_grpc, native, "identity", [server.pid]),
            ("frontdoor", fd_grpc, ours, "identity_native", [*replicas, *node_triton]),
            ("triton", node_grpc, ours, "identity_native", node_triton),
        ]
        for _, p, _, model, _ in paths:
            check_answers(p, model)
        if args.caller == "h2load":
            callers = f"h2load -c {args.conns} -m {args.streams} -n {args.calls}"
        else:
            callers = f"{args.conns} tritonclient.grpc callers, {args.calls} calls"
        print(f"{callers}, 1 MiB ModelInfer; answers checked")
        for r in range(args.rounds):
            for name, p, data, model, pids in paths[r % len(paths) :] + paths[: r % len(paths)]:
                before = sum(cpu_s(pid) for pid in pids)
                if args.caller == "h2load":
                    ok, wall, caller, summary = h2load(p, data, args)
                else:
                    ok, wall, caller, summary = grpcio(p, model, args)
                server_s = sum(cpu_s(pid) for pid in pids) - before
                per = 1000 / max(ok, 1)
                print(
                    f"round {r} {name:17s} {ok * ELEMENTS * 4 / 2**20 / wall:6.0f} MiB/s  ms/call: "
                    f"server {server_s * per:.2f}  h2load {caller * per:.2f}  | {summary}",
                    flush=True,
                )
    finally:
        for proto in protos:
            proto.terminate()
            proto.wait()
        control.unregister_system_shared_memory(headers=server.shm_api_headers)
        control.close()
        for f in files:
            f.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
