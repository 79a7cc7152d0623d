"""Owners known across pid namespaces: two "containers" that share /dev/shm but not a pid namespace.

Each namespace gets its own pid namespace and /proc, and the same directory bind-mounted on
its /dev/shm (what ``--ipc=host`` or a shared ``--ipc`` gives containers). The directory is
the test's own, not the machine's /dev/shm: a sweep in a pid namespace where the other
processes of this machine are invisible would take their segments (when made by an older
version, without locks) for stale, and this machine is shared.

Namespace A runs a real Triton with a client whose pools are registered with it, plus
a helper process that holds a segment; namespace B then starts its own server (whose
start sweeps stale segments) and runs the sweep directly. In B, A's pids mean another
live process (pid 1: B's own interpreter) or none at all; B must leave every one of A's
live segments alone (its own, its client's pools, its Triton's Python-backend files)
and still remove segments whose owner really died in another namespace. A then serves
requests through the same segments, and leaves nothing behind when it exits.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ray_triton_shm._private.shm import segment

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "deployments" / "models"


def _unshare_works() -> str | None:
    """Why two pid namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root to make pid namespaces (unshare --pid --mount-proc)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    try:
        out = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", "echo $$"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if out.returncode != 0 or out.stdout.strip() != "1":
        return f"unshare --pid --fork --mount-proc does not work here: {out.stderr.strip()}"
    return None


_WHY_NOT = _unshare_works()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")]

_NAMESPACE_A = """
import json, os, signal, subprocess, sys
import numpy as np
from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient
from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.shm.segment import Segment, new_segment_name

HOLD = "import sys, time; from ray_triton_shm._private.shm.segment import Segment, new_segment_name; " \\
       "s = Segment.create(new_segment_name(sys.argv[1]), 4096); print(s.name, flush=True); time.sleep(600)"

own = Segment.create(new_segment_name("nsa"), 4096)
own.mm[:8] = b"liveliv1"
server = TritonServer(ServerConfig(model_repository=sys.argv[1], load_models=("add_sub",)))
server.start()
pools = {"add_sub": PoolConfig(slots=2)}
client = TritonShmClient(url=server.grpc_url, http_url=server.http_url, pools=pools)
a = np.arange(32, dtype=np.int32).reshape(2, 16)
out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
assert out.path == "shm", out.path
holder = subprocess.Popen([sys.executable, "-c", HOLD, "nsahold"], stdout=subprocess.PIPE, text=True)
held = holder.stdout.readline().strip()
dying = subprocess.Popen([sys.executable, "-c", HOLD, "nsadead"], stdout=subprocess.PIPE, text=True)
dead = dying.stdout.readline().strip()
dying.send_signal(signal.SIGKILL)
dying.wait()
prefix = server._backend_prefix
print(json.dumps({
    "pid": os.getpid(), "holder_pid": holder.pid, "dead_pid": dying.pid,
    "own": own.name, "held": held, "dead": dead, "guard": prefix[:-1],
    "pools": sweep.list_segments(segment.owner_tag() + "_pool_"),
    "backend": sweep.list_segments(prefix),
}), flush=True)

assert sys.stdin.readline().strip() == "check"
# After B's sweep: the same pools, the same Python-backend files, the same segments serve on.
for _ in range(3):
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    assert out.path == "shm", out.path
    np.testing.assert_array_equal(out["OUTPUT0"], a + a)
    np.testing.assert_array_equal(out["OUTPUT1"], a - a)
with open(os.path.join(segment.SHM_DIR, own.name), "rb") as f:
    assert f.read(8) == b"liveliv1"
print(json.dumps({"ok": True}), flush=True)

assert sys.stdin.readline().strip() == "exit"
holder.kill()
holder.wait()
client.close()
server.stop()
own.close()
sweep.sweep_stale_segments()  # the killed holder's segment
print(json.dumps({"left": sweep.list_segments(segment.owner_tag() + "_")}), flush=True)
"""

_NAMESPACE_B = """
import json, os, sys
from ray_triton_shm import ServerConfig, TritonServer
from ray_triton_shm._private.shm import segment, sweep

seen = json.loads(sys.argv[2])
view = {str(pid): segment.process_start_time(pid) is not None for pid in seen}
removed = sweep.sweep_stale_segments()
with TritonServer(ServerConfig(model_repository=sys.argv[1])):  # a server start sweeps too
    pass
print(json.dumps({"pid": os.getpid(), "view": view, "removed": removed}), flush=True)
"""

_NAMESPACE_C = """
import os
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
seg = Segment.create(new_segment_name("nscdead"), 4096)
print(seg.name, flush=True)
os._exit(0)  # gone without cleanup, and its whole pid namespace with it
"""


def _in_namespace(shm_dir: Path, code: str, *args: str) -> list[str]:
    """A command running ``code`` as pid 1 of a new pid namespace whose /dev/shm is ``shm_dir``."""
    bind = 'mount --bind "$0" /dev/shm && exec "$@"'
    return [
        "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
        "sh", "-c", bind, str(shm_dir), sys.executable, "-c", code, *args,
    ]  # fmt: skip


def _read_json(proc: subprocess.Popen[str], timeout: float) -> dict:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no answer from namespace A within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"namespace A exited early (code {proc.poll()})"
    return json.loads(line)


def test_second_namespace_keeps_live_segments_and_sweeps_dead_ones(tmp_path: Path) -> None:
    empty = tmp_path / "empty_models"
    empty.mkdir()
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)

    def _exists(name: str) -> bool:
        return (shm / name).exists()

    a = subprocess.Popen(
        _in_namespace(shm, _NAMESPACE_A, str(MODEL_REPOSITORY)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        state = _read_json(a, 240)
        live = [state["own"], state["held"], state["guard"], *state["pools"], *state["backend"]]
        assert state["pid"] == 1, "namespace A's interpreter should be its pid 1"
        assert state["pools"], "A's client made no pool segment"
        assert state["backend"], "A's Triton made no Python-backend file"
        assert all(name.startswith(f"{segment.SEGMENT_PREFIX}_1_") for name in (state["own"], state["guard"]))
        assert all(_exists(name) for name in live), "namespace A's segments are not in the shared directory"
        assert _exists(state["dead"]), "the killed owner's segment should be left behind"

        c = subprocess.run(
            _in_namespace(shm, _NAMESPACE_C), capture_output=True, text=True, timeout=120, check=True
        )
        dead_elsewhere = c.stdout.strip()
        assert dead_elsewhere.startswith(f"{segment.SEGMENT_PREFIX}_1_") and _exists(dead_elsewhere)

        owners = [1, state["holder_pid"], state["dead_pid"]]
        b = subprocess.run(
            _in_namespace(shm, _NAMESPACE_B, str(empty), json.dumps(owners)),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert b.returncode == 0, b.stderr[-3000:]
        swept = json.loads(b.stdout.strip().splitlines()[-1])
        # In B, A's pid 1 is another live process (B itself); A's other pids name nothing.
        assert swept["pid"] == 1
        assert swept["view"] == {"1": True, str(state["holder_pid"]): False, str(state["dead_pid"]): False}

        taken = [name for name in live if not _exists(name)]
        assert not taken, f"namespace B removed live segments of namespace A: {taken}"
        assert not set(live) & set(swept["removed"])
        assert state["dead"] in swept["removed"] and not _exists(state["dead"])
        assert dead_elsewhere in swept["removed"] and not _exists(dead_elsewhere)

        assert a.stdin is not None
        a.stdin.write("check\n")
        a.stdin.flush()
        assert _read_json(a, 120) == {"ok": True}
        a.stdin.write("exit\n")
        a.stdin.flush()
        assert _read_json(a, 120) == {"left": []}
        assert a.wait(60) == 0
    finally:
        if a.poll() is None:
            a.kill()  # unshare's child, pid 1 of A, dies with it (and A's whole namespace)
            a.wait(30)
    left = sorted(os.listdir(shm))
    shutil.rmtree(shm, ignore_errors=True)
    assert not left, f"left in the shared /dev/shm: {left}"
