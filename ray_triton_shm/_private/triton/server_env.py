"""Finding a ``tritonserver`` binary and the environment it runs in.

The embedded default is the server bundled in the ``nvidia-pytriton`` wheel.
Its Python-backend stub runs the first ``python`` on ``PATH``, and with numpy 2
there every output comes back empty, so it gets a Python environment of its
own (numpy < 2), provisioned once into a cache directory and reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ray_triton_shm.config import ServerConfig
from ray_triton_shm.errors import ServerNotFoundError

logger = logging.getLogger(__name__)

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
NUMPY_REQUIREMENT = "numpy<2"
SYSTEM_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"

_HOW_TO_GET_ONE = (
    "Install one of: the NGC Triton container (/opt/tritonserver/bin/tritonserver), a "
    "tritonserver on PATH, or let ray_triton_shm provision the embedded server "
    f"({PYTRITON_REQUIREMENT} with {NUMPY_REQUIREMENT}; needs pip access once). "
    "Or point RAY_TRITON_SHM_TRITONSERVER at a binary."
)


@dataclass(frozen=True)
class LaunchPlan:
    """What to execute and with which environment.

    Attributes:
        binary: Path of ``tritonserver``.
        source: Where it was found (for logs): explicit, env, PATH, system, embedded.
        path_prefix: Directories to put first on ``PATH`` (the stub's Python).
        library_paths: Directories to put first on ``LD_LIBRARY_PATH``.
        extra_flags: Flags this binary needs (e.g. its backend directory).
    """

    binary: str
    source: str
    path_prefix: tuple[str, ...] = ()
    library_paths: tuple[str, ...] = ()
    extra_flags: tuple[str, ...] = field(default_factory=tuple)


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _site_packages(env_dir: Path) -> Path:
    return env_dir / "lib" / f"python{_python_tag()}" / "site-packages"


def embedded_plan(env_dir: Path) -> LaunchPlan | None:
    """The launch plan for the pytriton server inside ``env_dir``, if complete."""
    site = _site_packages(env_dir)
    tree = site / "pytriton" / "tritonserver"
    binary = tree / "bin" / "tritonserver"
    stub = tree / "backends" / "python" / "triton_python_backend_stub"
    if not (binary.is_file() and stub.is_file()):
        return None
    return LaunchPlan(
        binary=str(binary),
        source=f"embedded ({env_dir})",
        path_prefix=(str(env_dir / "bin"),),
        library_paths=(str(site / "nvidia_pytriton.libs"),),
        extra_flags=(f"--backend-directory={tree / 'backends'}",),
    )


def default_env_dir(cache_dir: str) -> Path:
    version = PYTRITON_REQUIREMENT.split("==")[1]
    return Path(cache_dir) / f"server-env-py{_python_tag()}-pytriton{version}"


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def provision_server_env(cache_dir: str) -> Path:
    """Create (once) the embedded server's Python environment.

    Safe to call from several processes at once: a file lock serialises them
    and the environment only appears, by rename, when complete.

    Args:
        cache_dir: Directory that holds provisioned environments.

    Returns:
        The environment's directory.

    Raises:
        ServerNotFoundError: pip failed (e.g. no network) or the wheel lacks a
            stub for this Python.
    """
    env_dir = default_env_dir(cache_dir)
    if embedded_plan(env_dir):
        return env_dir
    with _file_lock(env_dir.with_suffix(".lock")):
        if embedded_plan(env_dir):
            return env_dir
        logger.info(
            "provisioning the embedded Triton server environment at %s (%s, %s); done once",
            env_dir,
            PYTRITON_REQUIREMENT,
            NUMPY_REQUIREMENT,
        )
        staging = Path(tempfile.mkdtemp(prefix=env_dir.name + ".", dir=env_dir.parent))
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(staging)],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                [
                    str(staging / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--no-deps",
                    PYTRITON_REQUIREMENT,
                    NUMPY_REQUIREMENT,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            tree = _site_packages(staging) / "pytriton" / "tritonserver"
            stub = tree / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
            if not stub.is_file():
                raise ServerNotFoundError(
                    f"{PYTRITON_REQUIREMENT} has no Python-backend stub for Python {_python_tag()}"
                )
            shutil.copy2(stub, tree / "backends" / "python" / stub.name)
            # venvs hard-code their own path in scripts; only bin/python is used.
            os.rename(staging, env_dir)
            staging = env_dir  # nothing left to clean up
        except subprocess.CalledProcessError as e:
            raise ServerNotFoundError(
                f"provisioning the embedded Triton failed: {(e.stderr or '')[-2000:]}\n{_HOW_TO_GET_ONE}"
            ) from e
        finally:
            if staging != env_dir:
                shutil.rmtree(staging, ignore_errors=True)
    return env_dir


def find_tritonserver(config: ServerConfig, *, provision: bool = True) -> LaunchPlan:
    """Find the server to run, in order: explicit/env, PATH, /opt/tritonserver, embedded.

    ``config.binary`` already holds the explicit argument or, failing that,
    ``RAY_TRITON_SHM_TRITONSERVER``.

    Args:
        config: Server configuration.
        provision: Whether the embedded environment may be created if missing.

    Returns:
        A launch plan.

    Raises:
        ServerNotFoundError: Nothing usable was found.
    """
    python_prefix: tuple[str, ...] = ()
    if config.python_env:
        python_prefix = (str(Path(config.python_env) / "bin"),)
    if config.binary:
        if not os.access(config.binary, os.X_OK):
            raise ServerNotFoundError(f"tritonserver {config.binary!r} is not an executable file")
        return LaunchPlan(binary=config.binary, source="explicit", path_prefix=python_prefix)
    on_path = shutil.which("tritonserver")
    if on_path:
        return LaunchPlan(binary=on_path, source="PATH", path_prefix=python_prefix)
    if os.access(SYSTEM_TRITONSERVER, os.X_OK):
        return LaunchPlan(binary=SYSTEM_TRITONSERVER, source="system", path_prefix=python_prefix)
    if config.python_env:
        plan = embedded_plan(Path(config.python_env))
        if plan:
            return plan
        raise ServerNotFoundError(
            f"RAY_TRITON_SHM_SERVER_PYTHON_ENV={config.python_env!r} holds no pytriton server "
            f"with a stub for Python {_python_tag()}. {_HOW_TO_GET_ONE}"
        )
    plan = embedded_plan(default_env_dir(config.cache_dir))
    if plan:
        return plan
    if not provision:
        raise ServerNotFoundError(f"no tritonserver found. {_HOW_TO_GET_ONE}")
    env_dir = provision_server_env(config.cache_dir)
    plan = embedded_plan(env_dir)
    if plan is None:
        raise ServerNotFoundError(f"provisioned {env_dir} but found no server in it")
    return plan


NVIDIA_GPU_DIR = "/proc/driver/nvidia/gpus"
"""One entry per GPU the NVIDIA driver knows (no cupy or CUDA runtime needed to count them)."""


def machine_gpu_count() -> int:
    """NVIDIA GPUs on this machine, as the driver lists them; 0 without a driver."""
    try:
        return len(os.listdir(NVIDIA_GPU_DIR))
    except OSError:
        return 0


def cpu_fallback_warning(plan: LaunchPlan, gpus: int | None = None) -> str | None:
    """A loud warning when a machine with GPUs falls back to the CPU-only embedded server.

    Args:
        plan: The server found.
        gpus: GPUs on the machine; counted when ``None``.

    Returns:
        The warning, or ``None`` when there is nothing to warn about.
    """
    if not plan.source.startswith("embedded"):
        return None
    gpus = machine_gpu_count() if gpus is None else gpus
    if gpus <= 0:
        return None
    return (
        f"WARNING: this machine has {gpus} NVIDIA GPU(s), but the only Triton found is the CPU-only "
        f"embedded server ({plan.binary}): models run on the CPU (Python backend only) and no GPU is used. "
        f"For GPU models: {_HOW_TO_GET_ONE}"
    )
