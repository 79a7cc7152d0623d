"""One helper builds the node config from a Serve app's args: the app's and your own deployment's."""

from __future__ import annotations

import pytest

from ray_triton_shm.errors import ConfigError
from ray_triton_shm.node import NodeClient, NodeConfig

ARGS = {
    "model_repository": "examples",
    "quarantine_s": 5,
    "preload": ["add_sub"],
    "pools": {"multi_io": {"slots": 3}},
    "server": {"protect_shm_api": False},
}


def test_from_args_is_what_the_serve_app_builds():
    from ray_triton_shm.serve import build_node_config

    config = NodeConfig.from_args(**ARGS)
    assert config == build_node_config(**ARGS)
    assert config.pools["multi_io"].slots == 3 and config.preload == ("add_sub",)
    assert config.quarantine_s == 5 and config.server.protect_shm_api is False


def test_app_args_split_into_config_and_client_options():
    from ray_triton_shm._private.node.node_config import split_app_args

    config, options = split_app_args({**ARGS, "slots_per_model": "2", "memory": "auto"})
    assert config == NodeConfig.from_args(**ARGS)
    assert options == {"slots_per_model": 2, "memory": "auto"}
    assert split_app_args(ARGS)[1] == {"slots_per_model": None, "memory": "system"}


@pytest.mark.parametrize(
    "args, words",
    [
        ({"quarantine_sec": 1}, "unknown node settings"),
        ({"pools": {"m": {"slotz": 1}}}, "invalid node settings"),
        ({"model_repository": "/nonexistent/repo"}, "/nonexistent/repo"),
        ({"slots_per_model": "many"}, "slots_per_model"),
    ],
)
def test_bad_args_are_config_errors(args, words):
    with pytest.raises(ConfigError, match=words):
        NodeClient.from_args(args)  # fails before any Ray call
