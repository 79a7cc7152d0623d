"""Run the suite, or one tier of it, in parallel lanes: what ``make test`` and ``make test-slow`` run.

The suite is a list of jobs, each one pytest process: the unit tests, the
integration tests without Ray (everything outside ``tests/integration/on_ray``),
then each Ray test module in a job of its own (a Ray started, shut down and
started again in one process can hang). It has two tiers: ``fast``, the tests
not marked ``slow`` (``make test``), and ``slow``, the long scenarios marked so
(``make test-slow``); CI runs both. A job in a tier runs only that tier's tests
(``-m "not slow"`` or ``-m slow``), and none is started for a tier that has
none of its tests.
Most of a Ray module's time is waiting (for Ray, Serve, a Triton to start or
to come back after a kill), so two jobs side by side finish the suite in
about half the time on a 2-core machine. Jobs start longest first, by the
seconds recorded in ``tests/durations.json`` (a job not listed there counts
as a long one); a module marked ``pytest.mark.alone`` (it starts a cluster
with ``ray start``, which any ``ray.init()`` beside it would join) starts before
the others, with no other job that starts a Ray beside it (the job without
Ray may run meanwhile).

Each job's output is printed whole when the job ends, then a line with its
verdict and time; the run goes on after a failure and exits with the first
non-zero status after all jobs ended. ``--record`` writes the measured times
back to ``tests/durations.json``.

Example:
    $ python -m tests.lanes --lanes 2 --tier fast  # what make test runs
    $ python -m tests.lanes --lanes 2 --tier slow  # what make test-slow runs
    $ python -m tests.lanes --lanes 1 --record     # the whole suite, one job at a time; keep the times
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import PORTS_ENV

REPO = Path(__file__).resolve().parents[1]
RAY_DIR = Path("tests/integration/on_ray")
DURATIONS = REPO / "tests" / "durations.json"
UNIT = "tests/unit"
NOT_RAY = "integration-without-ray"
# A job not in the durations file starts among the first: an unknown one may be long.
UNKNOWN_S = 120.0
# The ports the tests' free_port hands out, split between the lanes: above Ray's worker ports
# (10002-19999 by default), below the kernel's ephemeral ones (32768 and up here).
PORTS = (20000, 31999)
_ALONE = re.compile(r"pytest\.mark\.alone\b")
_SLOW = re.compile(r"pytest\.mark\.slow\b")
_SLOW_MODULE = re.compile(r"^pytestmark\s*=.*pytest\.mark\.slow\b", re.MULTILINE)
NO_TESTS = 5  # pytest's exit status when it collected no test
TIERS = {"fast": "not slow", "slow": "slow", "all": ""}
"""Each tier's pytest marker expression: ``make test`` runs ``fast``, ``make test-slow`` ``slow``."""


@dataclass
class Job:
    """One pytest process: its name (a path, or ``integration-without-ray``) and its arguments.

    ``key`` names its time in ``tests/durations.json``: the name, with the tier added where
    the tier runs only some of the job's tests.
    """

    name: str
    args: list[str]
    ray: bool = True
    alone: bool = False
    key: str = ""
    status: int | None = None
    seconds: float = 0.0
    why: list[str] = field(default_factory=list)  # a failed job's own summary of its failure

    def __post_init__(self) -> None:
        self.key = self.key or self.name


def _slowness(files: list[Path]) -> tuple[bool, bool]:
    """(every test of these files is marked slow, some test is)."""
    texts = [f.read_text() for f in files]
    every = bool(texts) and all(_SLOW_MODULE.search(t) for t in texts)
    return every, any(_SLOW.search(t) for t in texts)


def _in_tier(name: str, args: list[str], files: list[Path], tier: str, **kw) -> Job | None:
    """The job for ``tier``, or ``None`` where the tier has none of its tests."""
    every, some = _slowness(files)
    if tier == "all" or (tier == "fast" and not some) or (tier == "slow" and every):
        return Job(name, args, **kw)
    if (tier == "fast" and every) or (tier == "slow" and not some):
        return None
    return Job(name, [*args, "-m", TIERS[tier]], key=f"{name} ({tier})", **kw)


def jobs(paths: list[str] | None = None, tier: str = "all") -> list[Job]:
    """The suite's jobs in ``tier`` (``fast``: what is not marked slow; ``slow``: what is;
    ``all``); with ``paths``, only those named."""
    if tier not in TIERS:
        raise ValueError(f"no such tier: {tier!r} (tiers: {', '.join(TIERS)})")
    outside_ray = sorted((REPO / "tests" / "integration").glob("test_*.py"))
    modules = sorted((REPO / RAY_DIR).glob("test_*.py"))
    names = {UNIT, NOT_RAY} | {str(module.relative_to(REPO)) for module in modules}
    candidates = [
        _in_tier(UNIT, [UNIT], sorted((REPO / UNIT).rglob("test_*.py")), tier, ray=False),
        _in_tier(NOT_RAY, ["tests/integration", f"--ignore={RAY_DIR}"], outside_ray, tier, ray=False),
    ]
    for module in modules:
        name = str(module.relative_to(REPO))
        alone = bool(_ALONE.search(module.read_text()))
        candidates.append(_in_tier(name, [name], [module], tier, alone=alone))
    found = [job for job in candidates if job is not None]
    if paths:
        unknown = sorted(set(paths) - names)
        if unknown:
            known = f"{UNIT}, {NOT_RAY} or {RAY_DIR}/test_*.py"
            raise SystemExit(f"lanes: no such job: {', '.join(unknown)} (jobs: {known})")
        found = [job for job in found if job.name in paths]
    return found


def _recorded() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


WHY_LINES = 12
WHY_WIDTH = 400


def failure_lines(output: str) -> list[str]:
    """What a failed pytest process says of its failure, in a few lines.

    The ``FAILED`` and ``ERROR`` lines of pytest's short summary (``-ra``), and a crash's
    ``Fatal Python error`` line; failing those, the output's last lines. At most
    ``WHY_LINES`` lines, each cut to ``WHY_WIDTH`` characters.
    """
    lines = output.splitlines()
    said = [line for line in lines if line.startswith(("FAILED ", "ERROR ", "Fatal Python error"))]
    if not said:
        said = [line for line in lines if line.strip()][-5:]
    if len(said) > WHY_LINES:
        said = [*said[: WHY_LINES - 1], f"... and {len(said) - WHY_LINES + 1} more"]
    return [line if len(line) <= WHY_WIDTH else line[: WHY_WIDTH - 3] + "..." for line in said]


class Runner:
    """Runs jobs in lanes; prints each job's output when it ends."""

    def __init__(self, lanes: int, pytest_args: list[str]) -> None:
        self.lanes = lanes
        self.pytest_args = pytest_args
        self._print_lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._procs_lock = threading.Lock()
        self._stopping = False

    def run(self, job: Job, lane: int = 0) -> None:
        if self._stopping:
            return
        command = [sys.executable, "-m", "pytest", *job.args, *self.pytest_args]
        span = (PORTS[1] - PORTS[0] + 1) // self.lanes
        low = PORTS[0] + lane * span
        env = {**os.environ, PORTS_ENV: f"{low}-{low + span - 1}"}
        start = time.monotonic()
        with tempfile.TemporaryFile() as out:
            # A session of its own: a stopped run kills the job's whole process group.
            proc = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            with self._procs_lock:
                self._procs.add(proc)
            try:
                job.status = proc.wait()
            finally:
                with self._procs_lock:
                    self._procs.discard(proc)
            job.seconds = time.monotonic() - start
            out.seek(0)
            text = out.read().decode("utf-8", "replace")
        if job.status == NO_TESTS and job.key != job.name:  # the tier's marker left none of its tests
            job.status = 0
        if job.status != 0:
            job.why = failure_lines(text)
        verdict = "passed" if job.status == 0 else f"FAILED (exit {job.status})"
        with self._print_lock:
            sys.stdout.write(f"\n===== {job.name} ({' '.join(command[1:])})\n")
            sys.stdout.write(text)
            sys.stdout.write(f"===== {job.name}: {verdict} in {job.seconds:.0f} s\n")
            sys.stdout.flush()

    def run_lanes(self, queue: list[Job]) -> None:
        """Run ``queue`` in order, each lane taking the first job that may run beside the running
        ones: a job marked alone only beside jobs without Ray, and nothing with Ray beside it."""
        ready = threading.Condition()
        running: list[Job] = []

        def fits(job: Job) -> bool:
            if job.alone:
                return all(not other.ray for other in running)
            return not (job.ray and any(other.alone for other in running))

        def lane(number: int) -> None:
            while True:
                with ready:
                    while True:
                        if not queue or self._stopping:
                            return
                        job = next((job for job in queue if fits(job)), None)
                        if job is not None:
                            break
                        ready.wait()
                    queue.remove(job)
                    running.append(job)
                try:
                    self.run(job, number)
                finally:
                    with ready:
                        running.remove(job)
                        ready.notify_all()

        threads = [
            threading.Thread(target=lane, args=(number,), daemon=True)
            for number in range(min(self.lanes, len(queue)))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)

    def stop(self) -> None:
        """Kill every running job's process group (their own teardown cannot run: Ray and Triton
        processes are reaped by the node actors' reapers and the next session's sweep)."""
        self._stopping = True
        with self._procs_lock:
            procs = list(self._procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lanes", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lanes",
        type=int,
        default=int(os.environ.get("RAY_TRITON_SHM_TEST_LANES", "2")),
        help="jobs side by side (default: $RAY_TRITON_SHM_TEST_LANES or 2)",
    )
    parser.add_argument("--record", action="store_true", help="write the times to tests/durations.json")
    parser.add_argument(
        "--job",
        action="append",
        dest="jobs",
        metavar="NAME",
        help=f"run only this job ({UNIT}, {NOT_RAY} or a Ray module's path); repeatable",
    )
    parser.add_argument(
        "--tier",
        choices=list(TIERS),
        default="all",
        help="fast: the tests not marked slow (make test); slow: those marked slow (make test-slow); all",
    )
    args, pytest_args = parser.parse_known_args(argv)
    if args.lanes < 1:
        parser.error("--lanes must be at least 1")

    todo = jobs(args.jobs, args.tier)
    recorded = _recorded()
    weight = {job.name: recorded.get(job.key, UNKNOWN_S) for job in todo}
    # Those marked alone first (they wait for nothing), then longest first.
    queue = sorted(todo, key=lambda job: (not job.alone, -weight[job.name]))
    runner = Runner(args.lanes, pytest_args)

    def on_signal(signum: int, _frame: object) -> None:
        runner.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    start = time.monotonic()
    print(
        f"{len(todo)} jobs ({args.tier} tier), {args.lanes} lane(s): {', '.join(job.key for job in queue)}",
        flush=True,
    )
    runner.run_lanes(queue)
    total = time.monotonic() - start

    print(f"\n===== {len(todo)} jobs ({args.tier} tier) in {total:.0f} s ({args.lanes} lane(s))")
    for job in sorted(todo, key=lambda job: -job.seconds):
        verdict = {0: "passed", None: "not run"}.get(job.status, f"FAILED ({job.status})")
        print(f"  {job.seconds:6.0f} s  {verdict:12}  {job.key}")
    failed = [job for job in todo if job.status not in (0, None)]
    if failed:
        # After the table, so that a report showing only the end of the output still says why.
        print("\n===== why they failed")
        for job in failed:
            print(f"  {job.key}:")
            for line in job.why:
                print(f"    {line}")
    if args.record:
        times = {**recorded, **{job.key: round(job.seconds) for job in todo if job.status == 0}}
        DURATIONS.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")
    failed = [job for job in todo if job.status != 0]
    return next((job.status or 1 for job in failed), 0)


if __name__ == "__main__":
    sys.exit(main())
