"""deployments/kuberay/rayservice.yaml: a RayService the KubeRay operator accepts, running our apps.

No KubeRay CRD ships in a Python package, so the manifest is checked against a
schema written here from the facts of KubeRay's ``ray.io/v1`` RayService CRD:
every field it marks required (``spec.rayClusterConfig``; ``headGroupSpec.template``;
each worker group's ``groupName``, ``minReplicas``, ``maxReplicas``, ``template``;
each pod's ``containers``; each container's and volume's ``name``) and the types
of the fields we set (``serveConfigV2`` a string, ``rayStartParams`` a map of
strings, replica counts integers, ``emptyDir.sizeLimit`` a quantity).
The embedded Serve config is parsed with Serve's own schema and built.
"""

from __future__ import annotations

import copy
import importlib
import math
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deployments" / "kuberay" / "rayservice.yaml"

_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
_QUANTITY = rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_CONTAINER = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string"},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "volumeMounts": {
            "type": "array",
            "items": {"type": "object", "required": ["name", "mountPath"]},
        },
        "resources": {
            "type": "object",
            "properties": {
                "requests": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
                "limits": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
            },
        },
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],  # the operator needs a pod spec to make pods from
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                "volumes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "emptyDir": {
                                "type": "object",
                                "properties": {
                                    "medium": {"type": "string"},
                                    "sizeLimit": {"type": ["string", "integer"], "pattern": _QUANTITY},
                                },
                            }
                        },
                    },
                },
            },
        }
    },
}
RAYSERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["rayClusterConfig"],
            "properties": {
                "serveConfigV2": {"type": "string"},
                "serviceUnhealthySecondThreshold": {"type": "integer"},
                "deploymentUnhealthySecondThreshold": {"type": "integer"},
                "rayClusterConfig": {
                    "type": "object",
                    "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["template"],
                            "properties": {"rayStartParams": _STRINGS, "template": _POD_TEMPLATE},
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["groupName", "minReplicas", "maxReplicas", "template"],
                                "properties": {
                                    "groupName": {"type": "string"},
                                    "replicas": {"type": "integer", "minimum": 0},
                                    "minReplicas": {"type": "integer", "minimum": 0},
                                    "maxReplicas": {"type": "integer", "minimum": 0},
                                    "rayStartParams": _STRINGS,
                                    "template": _POD_TEMPLATE,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return next(doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc["kind"] == "RayService")


@pytest.fixture(scope="module")
def serve_config(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _pods(manifest: dict) -> list[tuple[dict, dict]]:
    """(group spec, pod spec) of the head and every worker group."""
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [(group, group["template"]["spec"]) for group in groups]


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)([KMGT]i)?", str(quantity)).groups()
    return int(float(number) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit])


def test_valid_rayservice(manifest: dict) -> None:
    jsonschema.validate(manifest, RAYSERVICE_SCHEMA)


@pytest.mark.parametrize(
    "path",
    [
        ("spec", "rayClusterConfig"),
        ("spec", "rayClusterConfig", "headGroupSpec", "template"),
        ("spec", "rayClusterConfig", "workerGroupSpecs", 0, "groupName"),
        ("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"),
        ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "name"),
    ],
)
def test_schema_check_can_fail(manifest: dict, path: tuple) -> None:
    broken = copy.deepcopy(manifest)
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYSERVICE_SCHEMA)


def test_ray_start_params_must_be_strings(manifest: dict) -> None:
    broken = copy.deepcopy(manifest)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYSERVICE_SCHEMA)


def test_head_runs_no_replicas_and_workers_have_gpus(manifest: dict) -> None:
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    workers = cluster["workerGroupSpecs"]
    assert workers
    for group in workers:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        assert group["minReplicas"] < group["maxReplicas"]  # the autoscaler has room
        for container in group["template"]["spec"]["containers"]:
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert cluster["rayVersion"] == importlib.import_module("ray").__version__


def test_every_pod_has_dev_shm_in_memory_and_our_image(manifest: dict) -> None:
    dockerfile = (REPO / "deployments" / "docker" / "Dockerfile").read_text()
    assert "WORKDIR /opt/ray-triton-shm" in dockerfile and "[examples]" in dockerfile
    for group, pod in _pods(manifest):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            assert container["image"].endswith("/ray-triton-shm:latest")  # built from the Dockerfile
            mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert len(mounts) == 1
            empty_dir = volumes[mounts[0]["name"]]["emptyDir"]
            assert empty_dir["medium"] == "Memory"
            store = int(group.get("rayStartParams", {}).get("object-store-memory", 0))
            assert store > 0  # sized explicitly, so it fits /dev/shm next to the pools
            assert _bytes(empty_dir["sizeLimit"]) >= store + 512 * 2**20
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("PYTHONPATH") == "/opt/ray-triton-shm"  # deployments.image_app importable


def test_dev_shm_holds_the_pools(manifest: dict, serve_config: dict) -> None:
    """A GPU worker's /dev/shm holds its object store, every pool of every app (4-byte tensors) and 1 GiB."""
    pools = 0
    for application in serve_config["applications"]:  # generous: as if the apps did not share pools
        for pool in application["args"].get("pools", {}).values():
            shapes = pool.get("max_shapes", {}).values()
            pools += pool.get("slots", 1) * sum(4 * math.prod(s) for s in shapes)
    assert pools > 0
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        size = _bytes(pod["volumes"][0]["emptyDir"]["sizeLimit"])
        assert size >= int(group["rayStartParams"]["object-store-memory"]) + pools + 2**30


def test_serve_config_parses_and_builds(serve_config: dict) -> None:
    from ray.serve.schema import ServeDeploySchema

    from ray_triton_shm._private.node.node_config import split_app_args

    ServeDeploySchema.model_validate(serve_config)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # PYTHONPATH=/opt/ray-triton-shm in the pods
    fingerprints = set()
    for application in serve_config["applications"]:
        module, _, attr = application["import_path"].partition(":")
        builder = getattr(importlib.import_module(module), attr)
        args = application["args"]
        built = builder(args)
        assert type(built).__name__ == "Application"
        node_args = {k: v for k, v in args.items() if k not in ("model", "transport", "frontdoor")}
        fingerprints.add(split_app_args(node_args)[0].fingerprint())
        names = {d["name"] for d in application.get("deployments", [])}
        assert names <= {"TritonDeployment", "ImageEmbedder"}
    assert len(fingerprints) == 1  # the apps share one Triton per node


def test_serve_config_is_served_on_all_interfaces(serve_config: dict) -> None:
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # the pod IP, for KubeRay's serve service
    routes = [a["route_prefix"] for a in serve_config["applications"]]
    assert len(set(routes)) == len(routes)


def test_the_front_door_listens_on_the_pods_and_a_service_reaches_it(
    manifest: dict, serve_config: dict
) -> None:
    from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig

    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (triton,) = [a for a in serve_config["applications"] if a["import_path"] == "ray_triton_shm.serve:app"]
    door = FrontDoorConfig.from_args(triton["args"]["frontdoor"])
    assert door is not None and door.host == "0.0.0.0"  # the pod's IP, for the Service
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for group in groups:  # the replicas run on the workers (the head has no CPUs for them)
        template = group["template"]
        labels = template["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {door.http_port, door.grpc_port} <= ports
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {door.http_port, door.grpc_port}
