"""What a gRPC call of 1 MB costs the servers, four ways, with one caller (``h2load``) in one run.

The paths, taking turns each round:

* ``prototype``: ``proto_h2`` (``proto_h2.c`` here, built with ``cc`` on first use), a
  measurement prototype of the front door's per-call work in C, one thread per connection:
  HTTP/2 frames, the request tensor read straight into a shared-memory slot, the
  shared-memory request to Triton over HTTP, the answer written from the slot. It decodes
  no headers (every stream is taken as ``ModelInfer``), keeps no limits and is no server to
  ship: it measures the floor of that work. It uses a Triton of its own (the same native
  models).
* ``prototype-triton``: that Triton's own gRPC endpoint.
* ``frontdoor``: the front door's gRPC port of a Serve app (2 replicas, native server).
* ``triton``: the app's node Triton's own gRPC endpoint.

Each run is ``h2load -c CONNS -m STREAMS -n CALLS`` posting one ``ModelInfer`` message (an
``identity`` request of 262,144 FP32) with windows of 1 GiB; ``h2load`` (nghttp2) sends
DATA frames of 16 KB, as Go and Java clients do. Every path's answers are first checked
with ``tritonclient``. Server CPU per call: ``utime + stime`` from ``/proc`` of the path's
processes (the prototype and its Triton; the replicas, the node actor and the node's
Triton; Triton alone) around the run, over the calls it made.

Needs ``make native`` and Debian's ``nghttp2-client``. Run from the repository root::

    .venv/bin/python tools/grpc_c_floor/measure.py --rounds 4 --calls 3000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.service_pb2 as pb

from ray_triton_shm import ServerConfig, TritonServer
from ray_triton_shm._private.bench.attacks.judge import listening_pids
from ray_triton_shm._private.bench.frontdoor import _Setup
from ray_triton_shm._private.triton.server_launch import free_ports

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


def h2load(port: int, data: Path, args: argparse.Namespace) -> tuple[int, float, float, str]:
    """(calls answered 2xx, seconds, h2load's own CPU seconds, its summary line) of one run."""
    command = [
        "h2load",
        *("-c", str(args.conns), "-m", str(args.streams), "-n", str(args.calls)),
        *("-w", "30", "-W", "30", "-d", str(data)),
        *("-H", "content-type: application/grpc", "-H", "te: trailers"),
        f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer",
    ]
    before = os.times()
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    wall = time.monotonic() - started
    after = os.times()
    caller = after.children_user + after.children_system - before.children_user - before.children_system
    codes = next((line for line in out.splitlines() if line.startswith("status codes:")), "")
    ok = int(codes.split()[2]) if codes else 0
    summary = next((line for line in out.splitlines() if line.startswith("requests:")), out[-200:])
    return ok, wall, caller, summary


def build_prototype() -> Path:
    binary = HERE / "proto_h2"
    source = HERE / "proto_h2.c"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-Wall", "-o", str(binary), str(source), "-lpthread"], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    binary = build_prototype()
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
            run_paths(args, binary, server, work, fd_grpc, node_grpc, replicas, node_triton)
    finally:
        app.stop()


def run_paths(
    args: argparse.Namespace,
    binary: Path,
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
    proto = None
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
        (port,) = free_ports("127.0.0.1", 1)
        command = [str(binary), str(port), str(triton_http), key, "p", str(SLOTS), str(SLOT_BYTES)]
        proto = subprocess.Popen(command)
        time.sleep(0.5)
        native, ours = work / "native.bin", work / "ours.bin"
        native.write_bytes(grpc_message("identity"))
        ours.write_bytes(grpc_message("identity_native"))
        paths = [
            ("prototype", port, native, "identity", [proto.pid, server.pid]),
            ("prototype-triton", triton_grpc, native, "identity", [server.pid]),
            ("frontdoor", fd_grpc, ours, "identity_native", [*replicas, *node_triton]),
            ("triton", node_grpc, ours, "identity_native", node_triton),
        ]
        for _, p, _, model, _ in paths:
            check_answers(p, model)
        print(f"h2load -c {args.conns} -m {args.streams} -n {args.calls}, 1 MiB ModelInfer; answers checked")
        for r in range(args.rounds):
            for name, p, data, _, pids in paths[r % 4 :] + paths[: r % 4]:
                before = sum(cpu_s(pid) for pid in pids)
                ok, wall, caller, summary = h2load(p, data, args)
                server_s = sum(cpu_s(pid) for pid in pids) - before
                per = 1000 / max(ok, 1)
                print(
                    f"round {r} {name:17s} {ok * ELEMENTS * 4 / 2**20 / wall:6.0f} MiB/s  ms/call: "
                    f"server {server_s * per:.2f}  h2load {caller * per:.2f}  | {summary}",
                    flush=True,
                )
    finally:
        if proto is not None:
            proto.terminate()
            proto.wait()
        control.unregister_system_shared_memory(headers=server.shm_api_headers)
        control.close()
        for f in files:
            f.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
