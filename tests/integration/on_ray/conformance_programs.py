"""Running Triton's own client programs (tritonclient examples) against a front door, unchanged.

Used by ``test_conformance.py``: where the programs are found, which port each
gets, and how a run is shown when it fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROGRAMS_ENV = "RAY_TRITON_SHM_CONFORMANCE_DIR"
EXTRA_ENV = "RAY_TRITON_SHM_CONFORMANCE_EXTRA"
DEFAULT_PROGRAMS = REPO.parent / "shared" / "conformance" / "tritonclient_examples"
SHM_REFUSAL = "shared-memory registration is not supported by this endpoint"
PROGRAM_TIMEOUT_S = 300


def program_dir() -> Path:
    """Where the tritonclient example programs are: ``RAY_TRITON_SHM_CONFORMANCE_DIR``, or beside the repo."""
    return Path(os.environ.get(PROGRAMS_ENV) or DEFAULT_PROGRAMS)


def program_params(directory: Path | None, what: str) -> list:
    """One pytest param per program in ``directory``, or one that skips and says why."""
    if directory is None:
        return [pytest.param(None, id="none", marks=pytest.mark.skip(reason=f"{EXTRA_ENV} is not set"))]
    programs = sorted(directory.glob("*.py")) if directory.is_dir() else []
    if not programs:
        reason = f"no {what} in {directory} (set {PROGRAMS_ENV} / {EXTRA_ENV} to a directory of them)"
        return [pytest.param(None, id="absent", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(path, id=path.name) for path in programs]


@dataclass(frozen=True)
class FrontDoor:
    """Where a client outside Ray reaches the app: ``host:port`` of its HTTP and its gRPC listener."""

    http: str
    grpc: str

    def url_for(self, program: Path) -> str:
        """The address a program gets: gRPC programs (``grpc`` in the name) the gRPC port."""
        return self.grpc if "grpc" in program.name else self.http


def run_program(program: Path, url: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python program -u url``, unchanged; its /dev/shm regions removed if it left them."""
    regions = set(re.findall(r'create_shared_memory_region\(\s*"[^"]*",\s*"/([^"]+)"', program.read_text()))
    before = {name for name in regions if os.path.exists(f"/dev/shm/{name}")}
    try:
        return subprocess.run(
            [sys.executable, str(program), "-u", url],
            capture_output=True,
            text=True,
            timeout=PROGRAM_TIMEOUT_S,
            cwd=cwd,
        )
    finally:
        for name in regions - before:  # a refused registration ends the program before its cleanup
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def shown(result: subprocess.CompletedProcess) -> str:
    """A run's exit code and the tail of its output, for a failure message."""
    out, err = result.stdout[-4000:], result.stderr[-4000:]
    return f"exit {result.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


def extra_dir() -> Path | None:
    """The directory of more programs (``RAY_TRITON_SHM_CONFORMANCE_EXTRA``), if set."""
    value = os.environ.get(EXTRA_ENV)
    return Path(value) if value else None


REFUSALS = (SHM_REFUSAL, "this endpoint does not accept model files")


def meets_a_refusal(program: Path) -> bool:
    """Whether the program registers shared memory or uploads model files (the ingress refuses both)."""
    text = program.read_text()
    return bool(re.search(r"register_(system|cuda)_shared_memory\(|load_model\([^)]*files=", text, re.S))
