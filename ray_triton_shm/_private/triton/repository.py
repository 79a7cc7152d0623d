"""Model repositories: local directories, the example models, and the URIs Triton reads itself.

Triton reads ``s3://``, ``gs://`` and ``as://`` repositories on its own (the
embedded server is built with S3 support); those are passed through unchanged.
Local paths are made absolute so that a node actor started elsewhere finds them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from ray_triton_shm.errors import ConfigError

REMOTE_SCHEMES = ("s3://", "gs://", "as://")

_PACKAGE_DIR = Path(__file__).resolve().parents[2]


def is_remote(location: str) -> bool:
    """Whether ``location`` is a repository URI Triton reads itself (``s3://``, ``gs://``, ``as://``)."""
    return location.startswith(REMOTE_SCHEMES)


def examples_repository() -> str:
    """The example models: shipped inside the package (``ray_triton_shm/examples/models``) in a wheel,
    ``deployments/models`` in a source checkout.

    Raises:
        ConfigError: Neither exists (a broken install).
    """
    for candidate in (_PACKAGE_DIR / "examples" / "models", _PACKAGE_DIR.parent / "deployments" / "models"):
        if candidate.is_dir():
            return str(candidate)
    raise ConfigError(f"the example models are missing from this install ({_PACKAGE_DIR})")


def examples_serve_config() -> str:
    """The example Serve config (``deployments/triton_shm.yaml``, shipped in the package too).

    Raises:
        ConfigError: It is missing from this install.
    """
    packaged = _PACKAGE_DIR / "examples" / "triton_shm.yaml"
    for candidate in (packaged, _PACKAGE_DIR.parent / "deployments" / "triton_shm.yaml"):
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(f"the example Serve config is missing from this install ({_PACKAGE_DIR})")


def resolve_repository(value: str | None, *, must_exist: bool = True) -> str:
    """One repository as Triton should get it.

    ``examples`` (or nothing) is the example models; a URI Triton reads is kept
    as it is; a local path is made absolute.

    Raises:
        ConfigError: A local directory that does not exist (with ``must_exist``).
    """
    if not value or value == "examples":
        return examples_repository()
    if not isinstance(value, str):
        raise ConfigError(f"a model repository must be a path or URI string, got {value!r}")
    if is_remote(value):
        return value
    path = Path(value).expanduser().resolve()
    if must_exist and not path.is_dir():
        raise ConfigError(f"model repository {str(path)!r} does not exist")
    return str(path)


def resolve_repositories(
    value: str | Sequence[str] | None, *, must_exist: bool = True
) -> str | tuple[str, ...]:
    """:func:`resolve_repository` for one repository or several (Triton serves several at once).

    Returns:
        A string for one repository, a tuple for a sequence of them.

    Raises:
        ConfigError: As :func:`resolve_repository`, or an empty sequence.
    """
    if value is None or isinstance(value, str):
        return resolve_repository(value, must_exist=must_exist)
    resolved = tuple(resolve_repository(v, must_exist=must_exist) for v in value)
    if not resolved:
        raise ConfigError("at least one model repository is needed")
    return resolved


def local_directories(repositories: Sequence[str]) -> list[str]:
    """The repositories that are local directories (remote ones are Triton's to read)."""
    return [r for r in repositories if not is_remote(r) and os.path.isdir(r)]


_BACKEND = re.compile(r'^\s*backend\s*:\s*"([^"]+)"', re.MULTILINE)
_PLATFORM = re.compile(r'^\s*platform\s*:\s*"([^"]+)"', re.MULTILINE)


def python_backend_models(repositories: Sequence[str]) -> list[str] | None:
    """The models of ``repositories`` that run on Triton's Python backend.

    A model is a Python-backend one when its ``config.pbtxt`` names
    ``backend: "python"``, or names no backend nor platform and a version
    directory holds a ``model.py`` (Triton's own inference).

    Returns:
        Their names, sorted; ``None`` when a repository is remote (not ours to read).
    """
    found = []
    for repository in repositories:
        if is_remote(repository):
            return None
        root = Path(repository)
        if not root.is_dir():
            continue
        for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            config = model_dir / "config.pbtxt"
            text = config.read_text(errors="replace") if config.is_file() else ""
            backend = _BACKEND.search(text)
            if backend:
                is_python = backend.group(1) == "python"
            else:
                is_python = not _PLATFORM.search(text) and any(model_dir.glob("*/model.py"))
            if is_python:
                found.append(model_dir.name)
    return found
