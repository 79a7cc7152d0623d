"""The notebooks run, top to bottom, without a cell error (real Triton, real Ray).

Each notebook runs in its own kernel and starts (and shuts down) its own Ray;
the session checks of tests/conftest.py then see that none left segments or
Triton processes behind. The GPU notebook's cells tagged ``gpu`` are dropped
on machines without a GPU; its other cells run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[3] / "notebooks"
RUN = ["01_quickstart.ipynb", "02_serve_http.ipynb", "03_ray_data.ipynb", "04_gpu_cluster.ipynb"]
CELL_TIMEOUT_S = 300


def _has_gpu() -> bool:
    from ray_triton_shm._private.shm.cuda import device_count
    from ray_triton_shm.errors import CudaUnavailableError

    try:
        return device_count() > 0
    except CudaUnavailableError:
        return False


def _is_gpu(cell) -> bool:
    return "gpu" in cell.get("metadata", {}).get("tags", [])


def test_every_notebook_is_listed_and_matches_its_builder():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(RUN)
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        import build_notebooks
    finally:
        sys.path.remove(str(NOTEBOOKS))
    for name, cells in build_notebooks.NOTEBOOKS.items():
        stored = nbformat.read(str(NOTEBOOKS / name), as_version=4)
        nbformat.validate(stored)
        assert [c.source for c in stored.cells] == [c.source for c in cells], (
            f"{name} differs from notebooks/build_notebooks.py: run it"
        )
        assert not any(c.get("outputs") for c in stored.cells), f"{name} is stored with outputs"


def test_gpu_notebook_marks_and_guards_its_gpu_cells():
    nb = nbformat.read(str(NOTEBOOKS / "04_gpu_cluster.ipynb"), as_version=4)
    gpu_cells = [c for c in nb.cells if _is_gpu(c)]
    assert len(gpu_cells) >= 2
    assert all(c.source.startswith("if HAS_GPU:") for c in gpu_cells)
    assert any(c.cell_type == "code" and not _is_gpu(c) for c in nb.cells)


@pytest.mark.parametrize("name", RUN)
def test_notebook_runs(name: str) -> None:
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    if not _has_gpu():
        nb.cells = [c for c in nb.cells if not _is_gpu(c)]
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors
    if name == "03_ray_data.ipynb":
        assert any("image/png" in o.get("data", {}) for o in outputs), "no throughput plot"
