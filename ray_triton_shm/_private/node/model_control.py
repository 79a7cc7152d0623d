"""``ray-triton-shm models``: load, unload and reload models on every node's Triton.

Triton must run with explicit model control (``ServerConfig(model_control="explicit")``,
or ``load_models``). A reloaded model whose configuration changed gets a new
fingerprint; slot layouts derived from the old one are refused with
``LayoutMismatchError`` rather than used.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ray_triton_shm._private.node.node_config import NAME_PREFIX, NAMESPACE
from ray_triton_shm.errors import ConfigError

Writer = Callable[[str], None]


def node_actors() -> list[tuple[str, Any]]:
    """(node id, actor handle) of every node actor of the connected Ray cluster."""
    actors = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry.get("namespace") == NAMESPACE and name.startswith(NAME_PREFIX):
            try:
                actors.append((name[len(NAME_PREFIX) :], ray.get_actor(name, namespace=NAMESPACE)))
            except ValueError:
                continue  # gone between listing and lookup
    return sorted(actors, key=lambda pair: pair[0])


def apply(action: str, models: Sequence[str], config_json: str | None, write: Writer) -> int:
    """Run ``action`` (``load``, ``unload`` or ``reload``) for ``models`` on every node actor.

    Returns:
        0 when every node did it, 1 otherwise (each failure is written).
    """
    actors = node_actors()
    if not actors:
        write("no Triton node actors in this Ray cluster")
        return 1
    failed = 0
    for node_id, actor in actors:
        for model in models:
            call = (
                actor.unload_model.remote(model)
                if action == "unload"
                else actor.load_model.remote(model, config_json)
            )
            try:
                result = ray.get(call, timeout=300)
            except ray.exceptions.RayError as e:
                failed += 1
                write(f"node {node_id[:12]}: {action} {model} failed: {str(e).splitlines()[-1]}")
                continue
            fingerprint = result.get("fingerprint")
            done = f"{action}ed" if action != "reload" else "reloaded"
            write(
                f"node {node_id[:12]}: {done} {model}" + (f" (config {fingerprint})" if fingerprint else "")
            )
    return 1 if failed else 0


def run(address: str, action: str, models: Sequence[str], config_file: str | None, write: Writer) -> int:
    """Connect to Ray at ``address`` and :func:`apply`.

    Raises:
        ConnectionError: No Ray cluster at ``address``.
        ConfigError: ``config_file`` is not a JSON model configuration.
    """
    config_json = None
    if config_file:
        try:
            with open(config_file) as f:
                config_json = json.dumps(json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--config-file {config_file!r} is not a readable JSON model config: {e}"
            ) from e

    if address != "auto" and "RAY_AUTH_MODE" not in os.environ:
        token = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
        if os.path.exists(token):
            os.environ["RAY_AUTH_MODE"] = "token"
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        return apply(action, models, config_json, write)
    finally:
        ray.shutdown()
