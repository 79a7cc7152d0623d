"""cluster.yaml is a valid Ray cluster-launcher config that sets up what the project needs."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_valid_against_rays_own_schema(cluster: dict) -> None:
    from ray.autoscaler._private.util import validate_config

    validate_config(copy.deepcopy(cluster))  # raises jsonschema.ValidationError on a bad config


def test_schema_check_can_fail(cluster: dict) -> None:
    from ray.autoscaler._private.util import validate_config

    broken = copy.deepcopy(cluster)
    broken["docker"]["run_option"] = broken["docker"].pop("run_options")  # a typo
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)


def test_head_and_autoscaling_gpu_workers(cluster: dict) -> None:
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    workers = [t for name, t in types.items() if name != cluster["head_node_type"]]
    assert workers and all(t["min_workers"] < t["max_workers"] for t in workers)
    assert all(t["node_config"]["InstanceType"].startswith(("g", "p")) for t in workers)  # GPU families


def test_shared_memory_image_setup_and_serve(cluster: dict) -> None:
    docker = cluster["docker"]
    assert "--ipc=host" in docker["run_options"] or any("--shm-size" in o for o in docker["run_options"])
    assert (REPO / "deployments" / "docker" / "Dockerfile").is_file()
    dockerfile = (REPO / "deployments" / "docker" / "Dockerfile").read_text()
    assert "tritonserver" in dockerfile and "ray[" in dockerfile and "numpy<2" in dockerfile
    setup = " ".join(cluster["setup_commands"])
    assert "pip install" in setup and "ray-triton-shm" in setup
    head = " ".join(cluster["head_start_ray_commands"])
    assert "ray start --head" in head and "serve deploy" in head
    assert "deployments/triton_shm_gpu.yaml" in head
    assert (REPO / "deployments" / "triton_shm_gpu.yaml").is_file()


def test_the_deployed_app_listens_on_every_interface(cluster: dict) -> None:
    """The head's sed turns every 127.0.0.1 host of the app into 0.0.0.0: Serve's proxy and the front door."""
    import re

    head = " ".join(cluster["head_start_ray_commands"])
    match = re.search(r"sed 's/([^/]+)/([^/]+)/'", head)
    assert match, "the head rewrites the hosts of the config it deploys"
    old, new = match.groups()
    text = (REPO / "deployments" / "triton_shm_gpu.yaml").read_text()
    spec = yaml.safe_load("\n".join(line.replace(old, new, 1) for line in text.splitlines()))
    assert spec["http_options"]["host"] == "0.0.0.0"
    (app,) = spec["applications"]
    door = app["args"]["frontdoor"]
    assert door["host"] == "0.0.0.0" and door["http_port"] and door["grpc_port"]


def test_the_deployed_app_asks_for_what_only_gpu_workers_have(cluster: dict) -> None:
    """Replicas (and so the node actors and Tritons) land on GPU workers, never on the head."""
    spec = yaml.safe_load((REPO / "deployments" / "triton_shm_gpu.yaml").read_text())
    (deployment,) = spec["applications"][0]["deployments"]
    options = deployment["ray_actor_options"]
    assert 0 < options["num_gpus"] < 1, "a fraction, so several replicas share a GPU node"
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert not head["resources"].get("GPU") and head["max_workers"] == 0
    assert "--num-gpus" not in " ".join(cluster["head_start_ray_commands"])
