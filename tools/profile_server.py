"""Where Triton spends an in-place shm request: ``perf`` on the server and its Python-backend stubs.

Starts the embedded Triton with ``identity``, writes one input into a leased slot,
then records ``perf record --call-graph dwarf`` of the server and stub processes
while the same slot is run ``--calls`` times. Prints the time per call and the
callers of ``memmove`` (each is one full copy of the tensor), then the top symbols.
Needs ``perf`` and permission to profile the server (root, or
``kernel.perf_event_paranoid`` <= 1). Usage, from the repository root:

    .venv/bin/python tools/profile_server.py --megabytes 16 --calls 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient

REPOSITORY = Path(__file__).resolve().parents[1] / "deployments" / "models"


def _server_pids(server_pid: int) -> list[int]:
    """The server and every process below it (the stubs)."""
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(server_pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    return [server_pid, *(int(pid) for pid in children)]


def _report(data: str, *args: str) -> str:
    command = ["perf", "report", "-i", data, "--stdio", "--no-children", *args]
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=16, help="payload per request (MB)")
    parser.add_argument("--calls", type=int, default=200, help="calls recorded")
    parser.add_argument("--frequency", type=int, default=1000, help="perf samples per second")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.stderr.write("perf is not installed\n")
        return 2
    n = args.megabytes * 1024 * 1024 // 4
    pool = PoolConfig(slots=1, max_batch_size=1, max_shapes={"INPUT0": (n,), "OUTPUT0": (n,)})
    config = ServerConfig(model_repository=str(REPOSITORY), load_models=("identity",))
    with tempfile.TemporaryDirectory() as tmp, TritonServer(config) as server:
        data = os.path.join(tmp, "perf.data")
        pools = {"identity": pool}
        with TritonShmClient(url=server.grpc_url, http_url=server.http_url, pools=pools) as client:
            lease = client.lease("identity")
            try:
                lease.input("INPUT0", (1, n))[...] = np.random.default_rng(0).random((1, n), dtype=np.float32)
                for _ in range(20):
                    client.run(lease)
                pids = ",".join(str(pid) for pid in _server_pids(server.pid))
                sampling = ["-F", str(args.frequency), "--call-graph", "dwarf,8192"]
                record = subprocess.Popen(["perf", "record", "-q", *sampling, "-o", data, "-p", pids])
                time.sleep(1.0)  # perf attaches asynchronously
                began = time.perf_counter()
                for _ in range(args.calls):
                    client.run(lease)
                took = time.perf_counter() - began
                record.send_signal(signal.SIGINT)
                record.wait()
            finally:
                lease.release()
        mb_s = args.megabytes * 1024 * 1024 * args.calls / took / 1e6
        per_call_ms = took / args.calls * 1e3
        out = sys.stdout
        out.write(f"{args.calls} calls of {args.megabytes} MB: {per_call_ms:.2f} ms each, {mb_s:.0f} MB/s\n")
        out.write(_report(data, "-n", "--sort", "comm", "-g", "none"))
        copies = ("--sort", "comm,sym", "-g", "caller,1,callee,function,percent", "--symbol-filter=memmove")
        out.write(_report(data, *copies))
        symbols = _report(data, "--sort", "comm,dso,sym", "-g", "none")
        top = [line for line in symbols.splitlines() if "%" in line]
        out.write("\ntop symbols:\n" + "\n".join(top[:25]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
