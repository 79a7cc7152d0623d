"""Model changes on a running Triton (explicit model control): a reloaded model with another
configuration gets a new layout, and an old layout is refused with a typed error."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import LayoutMismatchError, ServerConfig, TritonCallError, TritonServer, TritonShmClient
from ray_triton_shm._private.shm.layout import config_fingerprint

from .conftest import MODEL_REPOSITORY


def test_reload_with_a_changed_config_gets_a_new_layout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "add_sub", repo / "add_sub")
    config = ServerConfig(model_repository=str(repo), model_control="explicit")
    assert config.server_flags()[-2:] == ["--model-control-mode=explicit", "--load-model=*"]
    with TritonServer(config) as server, TritonShmClient(url=server.grpc_url) as old:
        a16 = np.ones((2, 16), np.int32)
        assert old.infer("add_sub", {"INPUT0": a16, "INPUT1": a16}).path == "shm"
        first = old.layout("add_sub").fingerprint
        assert first == config_fingerprint(old._grpc.get_model_config("add_sub", as_json=True)["config"])

        pbtxt = repo / "add_sub" / "config.pbtxt"
        pbtxt.write_text(pbtxt.read_text().replace("dims: [ 16 ]", "dims: [ 8 ]"))
        old._grpc.load_model("add_sub")  # a reload: Triton reads the changed config
        with pytest.raises(LayoutMismatchError) as info:
            old.infer("add_sub", {"INPUT0": a16, "INPUT1": a16})
        assert info.value.layout_fingerprint == first and info.value.server_fingerprint != first
        assert all(s.busy == 0 for s in old.pool_stats())  # the slot went back

        with TritonShmClient(url=server.grpc_url) as new:
            a8 = np.arange(16, dtype=np.int32).reshape(2, 8)
            result = new.infer("add_sub", {"INPUT0": a8, "INPUT1": a8})
            assert result.path == "shm" and new.layout("add_sub").input("INPUT0").dims == (8,)
            np.testing.assert_array_equal(result["OUTPUT0"], 2 * a8)
            assert new.layout("add_sub").fingerprint == info.value.server_fingerprint

        old._grpc.unload_model("add_sub")
        with pytest.raises(TritonCallError):
            old.infer("add_sub", {"INPUT0": a16, "INPUT1": a16})
