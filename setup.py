"""Packaging hooks: the example models ship inside the package; the two C extensions.

All metadata lives in pyproject.toml. A wheel gets ``ray_triton_shm/examples/models``,
copied from ``deployments/models`` at build time, so ``examples`` works in any install;
a source checkout (editable install) uses ``deployments/models`` directly.

``_kserve_json`` reads and writes KServe v2 JSON tensors (see
``ray_triton_shm/_private/serve/protocol/kserve_json.py``). It is optional: where no C
compiler builds it, the package falls back to the json module. ``_h2_data`` reads runs of
HTTP/2 DATA frames straight into a slot (see
``ray_triton_shm/_private/serve/http2/h2_receive.py``); without it the same frames are read
one at a time in Python. ``_h2_engine`` serves a gRPC connection's HTTP/2 side with nghttp2
(see ``ray_triton_shm/_private/serve/http2/engine.py``; its parts share ``_h2_engine.h``); it
is built where nghttp2's headers are installed (Debian's ``libnghttp2-dev``), and without it
the front door's gRPC listener has only the Python engine.
"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
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


setup(
    cmdclass={"build_py": BuildPyWithExamples},
    ext_modules=[
        Extension(
            "ray_triton_shm._private.serve.protocol._kserve_json",
            sources=["ray_triton_shm/_private/serve/protocol/_kserve_json.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
        Extension(
            "ray_triton_shm._private.serve.http2._h2_data",
            sources=["ray_triton_shm/_private/serve/http2/_h2_data.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
        Extension(
            "ray_triton_shm._private.serve.http2._h2_engine",
            sources=[
                f"ray_triton_shm/_private/serve/http2/{name}.c"
                for name in ("_h2_engine", "h2e_send", "h2e_streams", "h2e_frames", "h2e_triton")
            ],
            depends=["ray_triton_shm/_private/serve/http2/_h2_engine.h"],
            libraries=["nghttp2"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
            optional=True,
        ),
    ],
)
