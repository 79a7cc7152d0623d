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
    from ray_triton_shm._private.node import model_control
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


def _shm_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


def test_a_changed_config_gets_a_new_pool_on_the_node(ray_local, tmp_path: Path) -> None:
    """Reloaded with other dims, through the node actor or behind its back: the node retires the old
    pool (its segments leave /dev/shm) and grants one of the new layout; NodeClient.infer just works."""
    import ray

    from ray_triton_shm import ServerConfig
    from ray_triton_shm._private.node import model_control
    from ray_triton_shm._private.shm.layout import config_fingerprint
    from ray_triton_shm.node import NodeClient, NodeConfig, ensure_node_actors, get_node_actor

    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "add_sub", repo / "add_sub")
    pbtxt = repo / "add_sub" / "config.pbtxt"
    original = pbtxt.read_text()
    config = NodeConfig(server=ServerConfig(model_repository=str(repo), model_control="explicit"))
    ensure_node_actors(config)
    actor = get_node_actor(config)  # the module's first test may have left its own node actor
    with NodeClient(config) as client, NodeClient(config) as other:
        a16 = np.arange(32, dtype=np.int32).reshape(2, 16)
        assert client.infer("add_sub", {"INPUT0": a16, "INPUT1": a16}).path == "shm"
        assert other.infer("add_sub", {"INPUT0": a16, "INPUT1": a16}).path == "shm"
        old = client.client.pool("add_sub")
        old_names = [old.region_name, old._table.name]
        assert all(_shm_exists(n) for n in old_names)

        # Reloaded through the node (the CLI's path): the node retires the pool at once.
        pbtxt.write_text(original.replace("dims: [ 16 ]", "dims: [ 8 ]"))
        lines: list[str] = []
        assert model_control.apply("reload", ["add_sub"], None, lines.append) == 0, lines
        assert not any(_shm_exists(n) for n in old_names), "the retired pool's segments are still there"
        a8 = np.arange(24, dtype=np.int32).reshape(3, 8)
        result = client.infer("add_sub", {"INPUT0": a8, "INPUT1": a8 + 1})
        assert result.path == "shm"
        np.testing.assert_array_equal(result["OUTPUT0"], 2 * a8 + 1)
        np.testing.assert_array_equal(result["OUTPUT1"], -np.ones_like(a8))
        new = client.client.pool("add_sub")
        assert new.layout.input("INPUT0").dims == (8,) and new.region_name != old_names[0]
        served = client.model_config("add_sub")
        assert new.layout.fingerprint == config_fingerprint(served)
        # The other process's client held the old grant: its next call takes the new one.
        result = other.infer("add_sub", {"INPUT0": a8, "INPUT1": a8})
        np.testing.assert_array_equal(result["OUTPUT0"], 2 * a8)
        assert other.client.pool("add_sub").region_name == new.region_name

        # Reloaded behind the node's back (straight through Triton): the client finds the mismatch,
        # the node retires the pool on its report, and the call is retried once on the new layout.
        pbtxt.write_text(original)
        second = [new.region_name, new._table.name]
        client.client._grpc.load_model("add_sub")
        result = client.infer("add_sub", {"INPUT0": a16, "INPUT1": a16})
        assert result.path == "shm"
        np.testing.assert_array_equal(result["OUTPUT0"], 2 * a16)
        assert client.client.pool("add_sub").layout.input("INPUT0").dims == (16,)
        assert not any(_shm_exists(n) for n in second)

        pools = ray.get(actor.stats.remote())["pools"]
        assert list(pools) == ["add_sub"] and pools["add_sub"]["in_use"] == 0, pools
    pools = ray.get(actor.stats.remote())["pools"]
    assert pools["add_sub"]["in_use"] == 0 and pools["add_sub"]["quarantined"] == 0, pools
