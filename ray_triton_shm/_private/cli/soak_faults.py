"""The fault soak: external callers through the front door while the app's processes are killed.

Deploys the applications of a Serve config file on a private local Ray (as
``serve run`` does), starts caller processes that use unmodified
``tritonclient.http`` and ``tritonclient.grpc`` (half each, see
:mod:`~ray_triton_shm._private.cli.soak_caller`) against the ports a client is told
to use, and meanwhile SIGKILLs, once each and spaced out, a Serve replica, the
node actor and the node's Triton. After each fault it waits until the killed
process is gone, its replacement runs and the front door answers correctly
again. Then it shuts down as the app's owner does (``serve.shutdown()``,
``ray.shutdown()``) and looks for what outlived the app: segments in /dev/shm
and processes of this run (every process of the run carries an environment
variable naming it, so processes of other Ray sessions on the machine are
never taken for ours, nor killed).

The run fails on any wrong answer, any error not in Triton's shape, a fault
not injected or not recovered from, a protocol with no correct answer after a
fault, a slot not returned, or anything left behind.

Run it with ``make soak-faults`` (10 minutes) or::

    python -m ray_triton_shm soak-faults --config deployments/triton_shm.yaml --duration 60
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ray_triton_shm._private.cli import soak_caller
from ray_triton_shm._private.cli.soak_report import (
    FAULTS,
    Fault,
    FaultSoakReport,
    FrontDoor,
    front_door,
    judge,
)
from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.triton.repository import examples_serve_config
from ray_triton_shm.errors import ConfigError, RayTritonShmError

MARK_ENV = "RAY_TRITON_SHM_SOAK_RUN"
"""Set in every process of a soak run (Ray's, Triton's, the callers') to the run's id."""
_OWNER_RE = re.compile(rf"^{segment.SEGMENT_PREFIX}_(\d+)_(\d+)_")
_EXPECTED_COMMAND = {"replica": "ServeReplica", "node-actor": "NodeActor", "triton": "tritonserver"}


class SoakError(RayTritonShmError):
    """The soak could not run (the app never answered before the first fault)."""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class _Processes:
    """Every process of this run seen so far (pid -> start time), found by the run's mark."""

    def __init__(self, run_id: str) -> None:
        self._needle = f"{MARK_ENV}={run_id}".encode()
        self.seen: dict[int, int] = {}

    def running(self) -> dict[int, int]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    marked = self._needle in f.read().split(b"\0")
            except OSError:
                continue
            start = segment.process_start_time(int(entry)) if marked else None
            if start is not None:
                found[int(entry)] = start
        self.seen.update(found)
        return found

    def is_ours(self, pid: int) -> bool:
        start = segment.process_start_time(pid)
        return start is not None and self.running().get(pid) == start


def _node_view(timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The node actor's pid, its Triton's pid and the Serve replicas using it (None: unreachable)."""
    import ray  # lazy: loads Ray (the CLI imports this module)

    from ray_triton_shm.node import get_node_actor  # lazy: loads Ray (the CLI imports this module)

    try:
        status = ray.get(get_node_actor().status.remote(), timeout=timeout_s)
    except Exception:  # restarting, or not there yet: the caller asks again
        return None
    info = status["info"]
    return {
        "node-actor": info["actor_pid"],
        "triton": info["triton_pid"],
        "replicas": sorted(u["pid"] for u in status["users"] if u["kind"] == "serve"),
        "pools": status["pools"],
        "healthy": status["health"]["state"] == "ok",
        "health": status["health"],
    }


def _wait(predicate: Callable[[], Any], timeout_s: float, step_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step_s)


class _Probe:
    """The driver's own external caller: one request per protocol, every value checked."""

    def __init__(self, door: FrontDoor, index: int) -> None:
        self._door, self._index, self._n = door, index, 0

    def answers(self) -> bool:
        for protocol in ("http", "grpc") if self._door.grpc_port else ("http",):
            self._n += 1
            model, inputs, expected = soak_caller.make_request(self._index, self._n)
            if protocol == "http":
                infer = soak_caller.http_caller(self._door.http_url, 10.0)
            else:
                infer = soak_caller.grpc_caller(self._door.grpc_url, 10.0, self._door.app)
            try:
                if soak_caller.check(expected, infer(model, inputs, list(expected))) is not None:
                    return False
            except Exception:
                return False
            finally:
                infer.close()  # type: ignore[attr-defined]
        return True


def _inject(target: str, processes: _Processes, write: Callable[[str], None]) -> Fault:
    """SIGKILL the process ``target`` names; refuses a pid that does not carry this run's mark."""
    fault = Fault(target)
    view = _wait(_node_view, 60.0)
    if view is None:
        fault.note = "the node actor did not answer, nothing killed"
        return fault
    pid = view["replicas"][0] if target == "replica" and view["replicas"] else view.get(target, -1)
    if not isinstance(pid, int) or pid <= 0 or not processes.is_ours(pid):
        fault.note = f"no process of this run to kill (view {view})"
        return fault
    command = _cmdline(pid)
    fault.pid, fault.command = pid, command.split()[0].rsplit("/", 1)[-1][:60] if command else ""
    if _EXPECTED_COMMAND[target] not in command:
        fault.note = f"pid {pid} is not a {target} ({command[:200]!r}), nothing killed"
        return fault
    start = segment.process_start_time(pid)
    fault.injected_at = time.time()
    os.kill(pid, signal.SIGKILL)
    fault.gone = bool(_wait(lambda: segment.process_start_time(pid) != start, 15.0, 0.05))
    write(f"fault {target}: SIGKILL pid {pid} ({fault.command})")
    return fault


def _await_recovery(fault: Fault, before: dict[str, Any], probe: _Probe, timeout_s: float) -> None:
    """Wait until ``fault``'s process is replaced and the front door answers correctly again."""

    def replaced() -> int | None:
        view = _node_view()
        if view is None or not view["healthy"]:
            return None
        if fault.target == "replica":
            fresh = [p for p in view["replicas"] if p not in before["replicas"]]
            return fresh[0] if fresh else None
        now = view[fault.target]
        return now if now > 0 and now != fault.pid else None

    fault.replaced_by = _wait(replaced, timeout_s)
    if fault.replaced_by is None or fault.injected_at is None:
        view = _node_view()
        fault.note = f"not replaced; node health: {view['health'] if view else 'node actor unreachable'}"
        return
    left = timeout_s - (time.time() - fault.injected_at)
    if _wait(probe.answers, max(left, 1.0)):
        fault.recovered_at = time.time()


def _start_callers(door: FrontDoor, count: int, out_dir: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """``count`` caller processes, alternating HTTP and gRPC (HTTP only when the app has no gRPC)."""
    callers = []
    for index in range(count):
        protocol = "grpc" if index % 2 and door.grpc_port else "http"
        url = door.grpc_url if protocol == "grpc" else door.http_url
        out = out_dir / f"caller-{index}.json"
        log = open(out_dir / f"caller-{index}.log", "wb")  # the caller process keeps it open
        command = [sys.executable, soak_caller.__file__, "--protocol", protocol, "--url", url]
        command += ["--caller", str(index), "--out", str(out), "--app", door.app]
        callers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), out))
        log.close()
    return callers


def _stop_callers(callers: list[tuple[subprocess.Popen[bytes], Path]], problems: list[str]) -> list[dict]:
    for proc, _ in callers:
        proc.send_signal(signal.SIGTERM)
    results = []
    for proc, out in callers:
        try:
            proc.wait(timeout=90)  # a request in flight may take its whole timeout
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            results.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            tail = out.with_suffix(".log").read_text(errors="replace")[-800:]
            problems.append(f"caller {out.stem} gave no counts (exit {proc.returncode}): {tail}")
    return results


def _leftovers(report: FaultSoakReport, processes: _Processes, shm_before: set[str], grace_s: float) -> None:
    """Wait up to ``grace_s`` for this run's processes and segments to go; record what stays."""

    def ours(name: str) -> bool:
        m = _OWNER_RE.match(name)
        return bool(m) and (
            int(m.group(1)) == os.getpid() or processes.seen.get(int(m.group(1))) == int(m.group(2))
        )

    def remaining() -> tuple[dict[int, int], list[str]]:
        return processes.running(), [n for n in sweep.list_segments() if n not in shm_before and ours(n)]

    _wait(lambda: not any(remaining()), grace_s)
    running, segments = remaining()
    report.leftover_processes = [f"{pid} {_cmdline(pid)[:100]}" for pid in sorted(running)]
    report.leftover_segments = segments
    report.stale_segments_of_others = [
        n for n in sweep.list_segments() if n not in shm_before and n not in segments and _owner_gone(n)
    ]


def _owner_gone(name: str) -> bool:
    m = _OWNER_RE.match(name)
    return bool(m) and segment.process_start_time(int(m.group(1))) != int(m.group(2))


def run_fault_soak(
    config_file: str | None = None,
    *,
    duration_s: float = 600.0,
    callers: int = 8,
    faults: Sequence[str] = FAULTS,
    host: str | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    app: str | None = None,
    recover_timeout_s: float = 240.0,
    write: Callable[[str], None] = print,
) -> FaultSoakReport:
    """Run the fault soak (see the module docstring) on a private local Ray; return its report.

    Args:
        config_file: Serve config file (default: the example config shipped with the package).
        duration_s: Least run time; the run goes on until the app has recovered from the
            last fault and answered for a while after it.
        callers: Caller processes, alternating HTTP and gRPC.
        faults: What to kill, in order: ``replica``, ``node-actor``, ``triton``.
        host, http_port, grpc_port: Where the callers connect (default: the config's).
        app: The application called (default: the config's first).
        recover_timeout_s: How long each fault may take to recover from.
        write: Where progress lines go.

    Raises:
        ConfigError: Bad arguments. SoakError: The app never answered before the first fault.
    """
    import ray  # lazy: loads Ray (the CLI imports this module)
    from ray import serve  # lazy: loads Ray (the CLI imports this module)

    unknown = sorted(set(faults) - set(FAULTS))
    if unknown or callers < 1 or duration_s <= 0:
        raise ConfigError(f"faults must be among {FAULTS} (got {unknown}), callers >= 1, duration > 0")
    config_file = config_file or examples_serve_config()
    door = front_door(config_file, host=host, http_port=http_port, grpc_port=grpc_port, app=app)
    report = FaultSoakReport(door)
    run_id = secrets.token_hex(8)
    processes = _Processes(run_id)
    shm_before = set(sweep.list_segments())
    previous_mark = os.environ.get(MARK_ENV)
    os.environ[MARK_ENV] = run_id  # inherited by Ray's processes, Triton's and the callers'
    out_dir = Path(tempfile.mkdtemp(prefix="rts-soak-faults-"))
    try:
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        try:
            _drive(
                report, config_file, processes, callers, faults, duration_s, recover_timeout_s, out_dir, write
            )
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        _leftovers(report, processes, shm_before, grace_s=60.0)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if previous_mark is None:
            os.environ.pop(MARK_ENV, None)
        else:
            os.environ[MARK_ENV] = previous_mark
    judge(report, faults)
    return report


def _drive(
    report: FaultSoakReport,
    config_file: str,
    processes: _Processes,
    count: int,
    faults: Sequence[str],
    duration_s: float,
    recover_timeout_s: float,
    out_dir: Path,
    write: Callable[[str], None],
) -> None:
    from ray_triton_shm.serve import run_config_file  # lazy: loads Ray (the CLI imports this module)

    door = report.front_door
    write(f"deploying {config_file}; callers will use HTTP {door.http_url}, gRPC {door.grpc_url}")
    run_config_file(config_file)
    probe = _Probe(door, index=count)
    if not _wait(probe.answers, 300.0, 1.0):
        raise SoakError(f"the front door (HTTP {door.http_url}, gRPC {door.grpc_url}) never answered")
    processes.running()
    callers = _start_callers(door, count, out_dir)
    report.began = time.time()
    write(f"{count} callers started; faults {', '.join(faults)} over {duration_s:.0f} s")
    try:
        ready_at = report.began
        for i, target in enumerate(faults):
            due = max(report.began + duration_s * (i + 1) / (len(faults) + 1.5), ready_at + 2.0)
            while time.time() < due:
                processes.running()
                time.sleep(min(1.0, max(due - time.time(), 0.0)))
            before = _wait(_node_view, 60.0) or {"replicas": []}
            processes.running()
            fault = _inject(target, processes, write)
            report.faults.append(fault)
            if fault.injected_at is None:
                break
            _await_recovery(fault, before, probe, recover_timeout_s)
            processes.running()
            if fault.recovered_at is None:
                write(f"fault {target}: no recovery within {recover_timeout_s:.0f} s")
                break
            write(f"fault {target}: recovered in {fault.recovery_s:.1f} s (new pid {fault.replaced_by})")
            ready_at = fault.recovered_at
        end = max(report.began + duration_s, ready_at + max(5.0, 0.1 * duration_s))
        while time.time() < end:
            processes.running()
            time.sleep(min(1.0, max(end - time.time(), 0.0)))
    finally:
        report.callers = _stop_callers(callers, report.problems)
        report.ended = time.time()
    _check_slots(report)


def _check_slots(report: FaultSoakReport) -> None:
    """Every slot of the node's pools is free again once the callers stopped (after quarantine)."""

    def lost() -> dict[str, int]:
        view = _node_view()
        if view is None:
            return {"(node actor unreachable)": -1}
        return {m: p["slots"] - p["free"] for m, p in view["pools"].items() if p["slots"] != p["free"]}

    remaining: dict[str, int] = {}

    def all_back() -> bool:
        nonlocal remaining
        remaining = lost()
        return not remaining

    _wait(all_back, 90.0, 1.0)
    report.slots_not_returned = remaining
