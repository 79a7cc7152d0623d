"""Model control through the node actor and ``ray-triton-shm models`` on a real local Ray."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ..conftest import MODEL_REPOSITORY

pytestmark = pytest.mark.slow


def test_load_unload_reload_through_the_node_actor_and_cli(ray_local, tmp_path: Path) -> None:
    import ray

    from ray_triton_shm import ServerConfig, TritonCallError
    from ray_triton_shm._private import model_control
    from ray_triton_shm.node import NodeClient, NodeConfig, ensure_node_actors, get_node_actor

    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "add_sub", repo / "add_sub")
    config = NodeConfig(server=ServerConfig(model_repository=str(repo), model_control="explicit"))
    ensure_node_actors(config)
    actor = get_node_actor()
    with NodeClient(config) as client:
        a = np.ones((1, 16), np.int32)
        assert client.infer("add_sub", {"INPUT0": a, "INPUT1": a}).path == "shm"

        lines: list[str] = []
        assert model_control.apply("unload", ["add_sub"], None, lines.append) == 0
        assert lines and "unloaded add_sub" in lines[0]
        states = {m["name"]: m["state"] for m in ray.get(actor.status.remote())["models"]}
        assert states["add_sub"] != "READY"
        with pytest.raises(TritonCallError):
            client.infer("add_sub", {"INPUT0": a, "INPUT1": a})

        lines.clear()
        assert model_control.apply("reload", ["add_sub"], None, lines.append) == 0
        assert "reloaded add_sub (config " in lines[0]
        np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], 2 * a)
        first = ray.get(actor.load_model.remote("add_sub"))["fingerprint"]
        assert first == client.client.layout("add_sub").fingerprint

        lines.clear()
        assert model_control.apply("load", ["no_such_model"], None, lines.append) == 1
        assert "failed" in lines[0]
