"""ray_triton_shm: NVIDIA Triton on Ray, with tensors moved through shared memory.

Example:
    >>> import numpy as np
    >>> from ray_triton_shm import ServerConfig, TritonServer, TritonShmClient
    >>> with TritonServer(ServerConfig(model_repository="deployments/models")) as server:  # doctest: +SKIP
    ...     with TritonShmClient(url=server.grpc_url) as client:
    ...         out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})

Importing this package does no work: the Ray layer (``ray_triton_shm.node``,
``ray_triton_shm.serve``, ``ray_triton_shm.data``) is only imported when one
of its names is first used.

The internals (``ray_triton_shm._private``) are grouped by layer, each of
which imports only the layers below it: shm, triton, core, node (Ray), serve,
bench, cli.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ray_triton_shm.client import InferResult, TritonShmClient
from ray_triton_shm.config import ClientConfig, PoolConfig, ServerConfig
from ray_triton_shm.errors import (
    ConfigError,
    CudaError,
    CudaUnavailableError,
    DeviceMappingError,
    FrontDoorError,
    InputError,
    LayoutError,
    LayoutMismatchError,
    LeaseReleasedError,
    ModelControlRefusedError,
    NoGpuError,
    OutputTooLargeError,
    OverloadedError,
    PoolClosedError,
    PoolTimeoutError,
    RayTritonShmError,
    RefusedError,
    RequestTooLargeError,
    ServerError,
    ServerNotFoundError,
    ServerStartError,
    SettingsRefusedError,
    SharedMemoryError,
    SharedMemoryRefusedError,
    SlotRefElsewhereError,
    SlotRefError,
    StaleSlotRefError,
    TritonCallError,
    UnavailableError,
)
from ray_triton_shm.server import TritonServer

if TYPE_CHECKING:
    from ray_triton_shm.data import TritonPredictor
    from ray_triton_shm.node import NodeClient, TritonNodeActor, ensure_node_actors, get_node_actor
    from ray_triton_shm.serve import SlotRef, SlotRefCaller

__version__ = "0.1.0"

_LAZY = {
    "TritonNodeActor": "ray_triton_shm.node",
    "NodeClient": "ray_triton_shm.node",
    "ensure_node_actors": "ray_triton_shm.node",
    "get_node_actor": "ray_triton_shm.node",
    "TritonPredictor": "ray_triton_shm.data",
    "SlotRef": "ray_triton_shm.serve",
    "SlotRefCaller": "ray_triton_shm.serve",
}

__all__ = [
    "ClientConfig",
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "DeviceMappingError",
    "FrontDoorError",
    "InferResult",
    "InputError",
    "LayoutError",
    "LayoutMismatchError",
    "LeaseReleasedError",
    "ModelControlRefusedError",
    "NoGpuError",
    "NodeClient",
    "OutputTooLargeError",
    "OverloadedError",
    "PoolClosedError",
    "PoolConfig",
    "PoolTimeoutError",
    "RayTritonShmError",
    "RefusedError",
    "RequestTooLargeError",
    "ServerConfig",
    "ServerError",
    "ServerNotFoundError",
    "ServerStartError",
    "SettingsRefusedError",
    "SharedMemoryError",
    "SharedMemoryRefusedError",
    "SlotRef",
    "SlotRefCaller",
    "SlotRefElsewhereError",
    "SlotRefError",
    "StaleSlotRefError",
    "TritonCallError",
    "TritonNodeActor",
    "TritonPredictor",
    "TritonServer",
    "TritonShmClient",
    "UnavailableError",
    "ensure_node_actors",
    "get_node_actor",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_triton_shm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
