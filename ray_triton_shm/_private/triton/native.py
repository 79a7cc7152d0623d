"""Where the native example models live, and whether their backend is built.

The models of ``deployments/native_models`` run on ``rts_native``, a Triton
backend in C (``native/rts_native.c``) that reads its inputs and writes its
outputs in the buffers Triton hands it: through shared memory, our own slots.
``make native`` compiles it and puts ``libtriton_rts_native.so`` in each model's
version directory. They sit in their own repository so that a checkout where it
was never built still serves ``deployments/models``: Triton stops at start when
a model of its repository fails to load. The models of
``deployments/native_models_gpu`` run on the same backend with ``KIND_GPU``
instances, which Triton loads only on a machine with a GPU, so they have a
repository of their own too.
"""

from __future__ import annotations

from pathlib import Path

from ray_triton_shm.errors import ServerStartError

BACKEND_LIBRARY = "libtriton_rts_native.so"


def native_model_repository() -> str:
    """``deployments/native_models`` of the source checkout."""
    return str(Path(__file__).resolve().parents[3] / "deployments" / "native_models")


def native_gpu_model_repository() -> str:
    """``deployments/native_models_gpu`` of the source checkout (``KIND_GPU`` models)."""
    return str(Path(__file__).resolve().parents[3] / "deployments" / "native_models_gpu")


def missing_backends(repository: str) -> list[str]:
    """Models of ``repository`` whose version 1 directory lacks the built backend."""
    root = Path(repository)
    return sorted(
        config.parent.name
        for config in root.glob("*/config.pbtxt")
        if not (config.parent / "1" / BACKEND_LIBRARY).is_file()
    )


def require_native_models(repository: str | None = None) -> str:
    """The native model repository, checked to be built.

    Args:
        repository: Defaults to :func:`native_model_repository`.

    Raises:
        ServerStartError: A model has no ``libtriton_rts_native.so`` (run ``make native``),
            or the repository has no models at all.
    """
    repository = repository or native_model_repository()
    if not list(Path(repository).glob("*/config.pbtxt")):
        raise ServerStartError(f"no native models in {repository}")
    missing = missing_backends(repository)
    if missing:
        raise ServerStartError(
            f"the native backend is not built for {missing} in {repository}: run `make native` "
            "(needs a C compiler)"
        )
    return repository
