"""Installed the way users install: a wheel built from this checkout, installed into a new venv,
run from another directory (the core demo against the embedded Triton).

The new venv gets only the wheel (``--no-deps``); its dependencies (ray, tritonclient, numpy)
come from this checkout's venv through a ``.pth`` path entry, so nothing is downloaded and the
package itself can only come from the wheel (the editable install's hooks are not processed there).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def build(out: Path) -> tuple[Path, Path, str]:
    """(wheel, sdist, build output) built from the checkout into ``out`` like ``make dist``."""
    build = _run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO_ROOT)], cwd=out)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return wheels[0], sdists[0], build.stdout + build.stderr


@dataclass(frozen=True)
class Installed:
    """A new venv with only the wheel installed, and a directory outside the checkout."""

    env_dir: Path
    python: Path
    site: Path
    elsewhere: Path

    @property
    def cli(self) -> Path:
        return self.env_dir / "bin" / "ray-triton-shm"


def install(wheel: Path, where: Path) -> Installed:
    """Install ``wheel`` alone into a new venv under ``where`` (dependencies from this venv)."""
    env_dir = where / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    new_site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], where
        ).stdout.strip()
    )
    (new_site / "checkout-venv-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    done = _run([*command, str(wheel)], where)
    assert done.returncode == 0, done.stdout + done.stderr
    elsewhere = where / "elsewhere"
    elsewhere.mkdir()
    return Installed(env_dir, python, new_site, elsewhere)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(wheel, sdist, build output) built from the checkout like ``make dist``."""
    return build(tmp_path_factory.mktemp("dist"))


def test_build_prints_no_deprecation_warnings(built: tuple[Path, Path, str]) -> None:
    wheel, _, output = built
    assert "deprecat" not in output.lower(), [ln for ln in output.splitlines() if "eprecat" in ln]
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "ray_triton_shm/examples/models/add_sub/config.pbtxt" in names
    assert "ray_triton_shm/examples/models/strings/1/model.py" in names
    assert "ray_triton_shm/examples/triton_shm.yaml" in names
    assert not any("__pycache__" in n for n in names)
    # The C reader and writer of JSON tensors, compiled for this interpreter.
    assert any(n.startswith("ray_triton_shm/_private/serve/protocol/_kserve_json.") for n in names), names


def test_wheel_in_a_new_venv_runs_the_demo_from_elsewhere(
    built: tuple[Path, Path, str], tmp_path: Path
) -> None:
    installed = install(built[0], tmp_path)
    python, new_site, elsewhere = installed.python, installed.site, installed.elsewhere
    where = _run(
        [
            str(python),
            "-c",
            "import ray_triton_shm, ray_triton_shm.serve as s; print(ray_triton_shm.__file__); "
            "print(s.build_node_config('examples').server.model_repository); "
            "from ray_triton_shm._private.serve.protocol import kserve_json; "
            "assert kserve_json.available(), 'no C extension in the wheel'",
        ],
        elsewhere,
    )
    assert where.returncode == 0, where.stderr
    module_file, examples = where.stdout.split()
    assert module_file.startswith(str(new_site)) and examples.startswith(str(new_site))
    assert Path(examples, "add_sub", "config.pbtxt").is_file()
    cli = installed.cli
    setup = _run([str(cli), "setup"], elsewhere)
    assert setup.returncode == 0 and "tritonserver:" in setup.stdout, setup.stderr
    demo = _run([str(cli), "demo", "--quick", "--core-only"], elsewhere)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert f"starting Triton (python backend) from {examples}" in demo.stdout
    assert "speedup" in demo.stdout and " NO" not in demo.stdout
    print(demo.stdout)  # quoted in the closing note
