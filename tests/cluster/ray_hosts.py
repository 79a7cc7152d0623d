"""Ray on the hosts of :mod:`tests.cluster.hosts`, started by the commands of ``cluster.yaml``.

``cluster.yaml`` is the source of the commands: its ``head_start_ray_commands``
and ``worker_start_ray_commands`` run as written, with what the cluster
launcher would fill in (``$RAY_HEAD_IP``) and three changes that this machine
needs: ``--autoscaling-config`` is dropped (no cloud provider here), every
``ray start`` gets ``--node-ip-address`` (the host's bridge address) and the
size of the host (``--num-cpus``, ``--object-store-memory``), and the Serve
config the head deploys is the app of ``deployments/triton_shm.yaml`` (this
machine has no GPU for ``triton_shm_gpu.yaml``) written into the head's /tmp.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "cluster.yaml"
SERVE_CONFIG = REPO / "deployments" / "triton_shm.yaml"
GPU_CONFIG_IN_CLUSTER = "/opt/ray-triton-shm-src/deployments/triton_shm_gpu.yaml"
"""The Serve config cluster.yaml's head deploys (the synced checkout's GPU config)."""
APP_CONFIG = "/tmp/cluster_app.yaml"
"""Where the head's copy of the app's config goes (the head's own /tmp)."""
GCS_PORT = 6379

# Models this test loads into each host's Triton (the shipped config loads every example model, a
# Python-backend stub each: too much for four Tritons on a 2-core machine), with the shipped pools.
MODELS = ("identity", "add_sub", "whoami")


def cluster_spec() -> dict[str, Any]:
    """cluster.yaml, parsed."""
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _ray_start(command: str, extra: list[str]) -> str:
    """A ``ray start`` command of cluster.yaml as run on a host here (see the module docstring)."""
    words = [w for w in shlex.split(command) if not w.startswith("--autoscaling-config")]
    return shlex.join([*words, *extra])


def start_commands(
    role: str, address: str, head_address: str, num_cpus: int, object_store_bytes: int
) -> list[str]:
    """The shell commands that start Ray on a host: ``role`` is ``head`` or ``worker``.

    The head's Serve deploy (the last head command) is left out: :func:`deploy_command`.
    """
    spec = cluster_spec()
    commands = spec["head_start_ray_commands" if role == "head" else "worker_start_ray_commands"]
    extra = [
        f"--node-ip-address={address}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_bytes}",
        "--disable-usage-stats",
    ]
    out = []
    for command in commands:
        command = " ".join(command.split())
        if command.startswith("ray start"):
            out.append(_ray_start(command.replace("$RAY_HEAD_IP", head_address), extra))
        elif command.startswith("ray stop"):
            out.append(command)
    return out


def deploy_command() -> str:
    """cluster.yaml's Serve deploy on the head, on the app config this test writes to the head's /tmp."""
    spec = cluster_spec()
    (deploy,) = [c for c in spec["head_start_ray_commands"] if "serve deploy" in c]
    deploy = " ".join(deploy.split())
    if GPU_CONFIG_IN_CLUSTER not in deploy:
        raise AssertionError(f"cluster.yaml's head no longer deploys {GPU_CONFIG_IN_CLUSTER}: {deploy}")
    return deploy.replace(GPU_CONFIG_IN_CLUSTER, APP_CONFIG)


def app_config(num_replicas: int, max_replicas_per_node: int) -> dict[str, Any]:
    """deployments/triton_shm.yaml for these hosts: the front door and proxies as shipped (cluster.yaml's
    deploy opens them to the network), ``num_replicas`` replicas spread over the hosts, a quarter CPU
    each, only :data:`MODELS` loaded."""
    spec = copy.deepcopy(yaml.safe_load(SERVE_CONFIG.read_text()))
    (app,) = spec["applications"]
    args = app["args"]
    args["pools"] = {name: pool for name, pool in args["pools"].items() if name in MODELS}
    args["server"] = {"load_models": list(MODELS)}
    (deployment,) = app["deployments"]
    deployment.update(
        num_replicas=num_replicas,
        max_replicas_per_node=max_replicas_per_node,
        ray_actor_options={"num_cpus": 0.25},
    )
    return spec


def app_args(spec: dict[str, Any]) -> dict[str, Any]:
    """The app's args in a Serve config (what the Data job gives ``split_app_args``)."""
    return spec["applications"][0]["args"]
