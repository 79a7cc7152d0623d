"""The two servers the benchmark measures, served by one Triton.

``native``: the models of ``deployments/native_models`` on ``rts_native``, the C
backend that reads its inputs and writes its outputs where Triton hands them
over (through shared memory, our own regions), as ONNX Runtime, TensorRT or any
C/C++ backend does: the client's own work is the cost. ``python``: the example
models on Triton's Python backend, which copies every tensor four times per
request. One repository holds both (the native models renamed ``*_native``),
so one Triton, one Ray and one node actor serve the whole run.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ray_triton_shm._private.triton.native import require_native_models
from ray_triton_shm.errors import ConfigError


@dataclass(frozen=True)
class BenchServer:
    """One server of the run: its name and the names its two models have in the run's repository."""

    name: str
    identity: str
    multi_io: str
    title: str


SERVERS: dict[str, BenchServer] = {
    "native": BenchServer(
        "native",
        "identity_native",
        "multi_io_native",
        "native C backend (rts_native: reads and writes our regions in place)",
    ),
    "python": BenchServer(
        "python", "identity", "multi_io", "Python backend (copies each tensor four times per request)"
    ),
}
"""Servers by name, in report order: the native one is the main table."""

_MODELS = ("identity", "multi_io")


def parse_servers(text: str | None) -> tuple[str, ...]:
    """``native,python`` -> names, checked.

    Raises:
        ConfigError: An unknown name.
    """
    if not text:
        return tuple(SERVERS)
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        raise ConfigError(f"unknown servers {unknown}; known: {list(SERVERS)}")
    return names


def _copy_model(source: Path, into: Path, name: str) -> None:
    target = into / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.tmp", "__pycache__"))
    config = target / "config.pbtxt"
    text, count = re.subn(r'^name:\s*"[^"]*"', f'name: "{name}"', config.read_text(), count=1, flags=re.M)
    if count != 1:
        raise ConfigError(f"{source / 'config.pbtxt'} has no name line")
    config.write_text(text)


def build_repository(
    servers: tuple[str, ...], python_repository: str, native_repository: str | None, into: Path
) -> Path:
    """The run's model repository in ``into``: each server's identity and multi_io.

    Raises:
        ServerStartError: The native backend is not built (``make native``).
        FileNotFoundError: A model is missing from its repository.
    """
    into.mkdir(parents=True, exist_ok=True)
    if "native" in servers:
        native = Path(require_native_models(native_repository))
        for model in _MODELS:
            _copy_model(native / model, into, getattr(SERVERS["native"], model))
    if "python" in servers:
        for model in _MODELS:
            _copy_model(Path(python_repository) / model, into, getattr(SERVERS["python"], model))
    return into
