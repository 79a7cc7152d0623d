"""Model repositories: URIs pass through, local paths are made absolute, the Python-backend setup
applies only where it is needed, and a GPU machine on the CPU-only server is warned about. No server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_triton_shm import ServerConfig, TritonServer
from ray_triton_shm._private.node.node_config import NodeConfig
from ray_triton_shm._private.triton import server_env
from ray_triton_shm._private.triton.repository import (
    examples_repository,
    python_backend_models,
    resolve_repositories,
)
from ray_triton_shm._private.triton.server_env import LaunchPlan, cpu_fallback_warning
from ray_triton_shm.errors import ConfigError
from ray_triton_shm.serve import build_node_config, resolve_model_repository

URIS = [
    "s3://http://127.0.0.1:9000/bucket/models",
    "s3://bucket/models",
    "gs://bucket/models",
    "as://acct/c/m",
]
EXAMPLES = Path(__file__).resolve().parents[2] / "deployments" / "models"


@pytest.mark.parametrize("uri", URIS)
def test_uris_pass_through_every_entry_point(uri: str) -> None:
    assert resolve_model_repository(uri) == uri
    assert build_node_config(uri).server.model_repository == uri
    assert NodeConfig.for_repository(uri).server.model_repository == uri
    assert ServerConfig(model_repository=uri).server_flags()[0] == f"--model-repository={uri}"


def test_several_repositories_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    config = build_node_config([URIS[0], "mine", "examples"])
    assert config.server.model_repository == (URIS[0], str(tmp_path / "mine"), examples_repository())
    flags = [f for f in config.server.server_flags() if f.startswith("--model-repository=")]
    assert flags == [f"--model-repository={r}" for r in config.server.model_repositories]
    assert NodeConfig.for_repository(["mine", URIS[2]]).server.model_repositories == (
        str(tmp_path / "mine"),
        URIS[2],
    )


def test_local_paths_are_absolute_and_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "repo").mkdir()
    assert resolve_model_repository("repo") == str(tmp_path / "repo")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_repository("missing")
    with pytest.raises(ConfigError, match="at least one"):
        resolve_repositories([])
    with pytest.raises(ConfigError, match="model_repository"):
        ServerConfig(model_repository=())
    with pytest.raises(ConfigError, match="sequence of strings"):
        ServerConfig(model_repository=("a", 3))  # type: ignore[arg-type]


def test_examples_are_found_in_a_checkout() -> None:
    assert Path(examples_repository()).samefile(EXAMPLES)
    assert resolve_model_repository(None) == resolve_model_repository("examples") == examples_repository()


def test_python_backend_models_are_detected(tmp_path: Path) -> None:
    found = python_backend_models([str(EXAMPLES)])
    assert found is not None and {"add_sub", "strings", "reshape"} <= set(found)
    (tmp_path / "onnx_model" / "1").mkdir(parents=True)
    (tmp_path / "onnx_model" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    (tmp_path / "inferred" / "1").mkdir(parents=True)
    (tmp_path / "inferred" / "1" / "model.py").write_text("")  # no config: Triton infers python
    assert python_backend_models([str(tmp_path)]) == ["inferred"]
    (tmp_path / "inferred" / "1" / "model.py").unlink()
    assert python_backend_models([str(tmp_path)]) == []
    assert python_backend_models([str(tmp_path), URIS[1]]) is None  # remote: unknown


def _environment(repository: str, **overrides: object) -> dict[str, str]:
    server = TritonServer(ServerConfig(model_repository=repository, **overrides))  # type: ignore[arg-type]
    plan = LaunchPlan(binary="/bin/true", source="PATH", path_prefix=("/stub-python/bin",))
    return server._environment(plan)


def test_python_backend_setup_only_where_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("RAY_TRITON_SHM_PYTHON_BACKEND", raising=False)
    caplog.set_level("INFO", logger="ray_triton_shm.server")
    with_python = _environment(str(EXAMPLES))
    assert with_python["PATH"].startswith("/stub-python/bin")
    assert "glibc.malloc.mmap_threshold" in with_python["GLIBC_TUNABLES"]
    assert "applied (" in caplog.text and "Python-backend model(s)" in caplog.text
    caplog.clear()
    without = _environment(str(tmp_path))
    assert not without["PATH"].startswith("/stub-python/bin")
    assert "GLIBC_TUNABLES" not in without
    assert "not applied (no Python-backend models" in caplog.text
    asked = _environment(str(tmp_path), python_backend=True)
    assert "glibc.malloc.mmap_threshold" in asked["GLIBC_TUNABLES"]
    assert "GLIBC_TUNABLES" not in _environment(str(EXAMPLES), python_backend=False)
    assert "GLIBC_TUNABLES" in _environment(URIS[1])  # remote: may hold Python models
    monkeypatch.setenv("RAY_TRITON_SHM_PYTHON_BACKEND", "0")
    assert ServerConfig(model_repository="x").python_backend is False


def test_cpu_fallback_on_a_gpu_machine_is_a_loud_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    embedded = LaunchPlan(binary="/cache/tritonserver", source="embedded (/cache)")
    assert cpu_fallback_warning(embedded, gpus=0) is None
    assert cpu_fallback_warning(LaunchPlan(binary="/opt/t", source="system"), gpus=4) is None
    warning = cpu_fallback_warning(embedded, gpus=2)
    assert warning is not None and warning.startswith("WARNING") and "2 NVIDIA GPU(s)" in warning
    monkeypatch.setattr(server_env, "NVIDIA_GPU_DIR", "/nonexistent")
    assert server_env.machine_gpu_count() == 0
    assert cpu_fallback_warning(embedded) is None


def test_setup_command_shows_the_warning(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    from ray_triton_shm._private.cli import cli

    for i in range(2):
        (tmp_path / str(i)).mkdir()
    monkeypatch.setattr(server_env, "NVIDIA_GPU_DIR", str(tmp_path))  # a faked machine with 2 GPUs
    monkeypatch.setattr(
        server_env, "find_tritonserver", lambda config, **kw: LaunchPlan("/c/tritonserver", "embedded (/c)")
    )
    assert cli.main(["setup"]) == 0
    out = capsys.readouterr()
    assert "tritonserver: /c/tritonserver" in out.out
    assert "WARNING: this machine has 2 NVIDIA GPU(s)" in out.err
    assert os.path.isdir(tmp_path)
