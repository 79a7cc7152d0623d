"""Packaging hook: the example models (``deployments/models``) ship inside the package.

All metadata lives in pyproject.toml. A wheel gets ``ray_triton_shm/examples/models``,
copied from ``deployments/models`` at build time, so ``examples`` works in any install;
a source checkout (editable install) uses ``deployments/models`` directly.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DEPLOYMENTS = Path(__file__).resolve().parent / "deployments"
EXAMPLES = DEPLOYMENTS / "models"
SERVE_CONFIG = DEPLOYMENTS / "triton_shm.yaml"


class BuildPyWithExamples(build_py):
    """``build_py`` that also copies the example model repository into the package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or not EXAMPLES.is_dir():
            return
        target = Path(self.build_lib) / "ray_triton_shm" / "examples"
        shutil.copytree(
            EXAMPLES,
            target / "models",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        if SERVE_CONFIG.is_file():
            shutil.copy2(SERVE_CONFIG, target / SERVE_CONFIG.name)


setup(cmdclass={"build_py": BuildPyWithExamples})
