"""Case 10 for the node actor: grant and lease cycles keep its (and its Triton's) RSS and fds flat.

`make test` runs 400 grant and 1,600 lease cycles; `make soak` sets
RAY_TRITON_SHM_LEAK_CYCLES=100000 (10,000 grant and 40,000 lease cycles).
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO_MODELS = str(Path(__file__).resolve().parents[3] / "deployments" / "models")


def setup_module(module):
    # Ray workers cannot import test modules: ship this one's functions by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def test_grant_cycles_keep_the_node_actor_and_its_triton_flat(ray_local):
    """Case 10 for the node actor: attach/grant/detach cycles, then NodeClient leases; RSS and fds flat."""
    import ray

    from ray_triton_shm import ServerConfig
    from ray_triton_shm.node import NodeClient, NodeConfig, ensure_node_actors, get_node_actor

    from ..footprint import Footprint, assert_flat, process_footprint, triton_ports

    # Only the model called here: a Triton with every model takes seconds more to start and stop.
    server = ServerConfig(model_repository=REPO_MODELS, load_models=("add_sub",))
    config = NodeConfig(server=server, quarantine_s=1.0, idle_shutdown_s=None)
    ensure_node_actors(config)
    actor = get_node_actor()
    actor_pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))

    def settle() -> None:
        # Collect garbage and hand the allocator's cached free pages back to the kernel in
        # the actor, so that RSS shows live memory rather than how glibc keeps free lists.
        ray.get(actor.__ray_call__.remote(lambda self: (gc.collect(), ctypes.CDLL(None).malloc_trim(0))))

    cycles = max(500, int(os.environ.get("RAY_TRITON_SHM_LEAK_CYCLES", "4000")) // 10)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)

    def grant_cycles(n: int) -> None:
        for i in range(n):
            user = f"leak-{i}"
            assert ray.get(actor.attach.remote(user, os.getpid(), "test")).triton_pid > 0
            assert ray.get(actor.acquire.remote("add_sub")).model == "add_sub"
            assert ray.get(actor.detach.remote(user))

    with NodeClient(config, slots_per_model=1) as client:

        def lease_cycles(n: int) -> None:
            for i in range(n):
                out = client.infer("add_sub", {"INPUT0": a + i, "INPUT1": a})
                assert out["OUTPUT0"][0, 0] == i

        # Warm-up longer than the measured run: the actor's RSS climbs for the first few
        # thousand Ray calls (Ray's own buffers and allocator arenas), then levels off.
        grant_cycles(max(cycles * 2, 3000))
        lease_cycles(cycles * 4)
        triton_pid = client.info.triton_pid
        ports = triton_ports(client.info.grpc_url, client.info.http_url)

        def footprints() -> dict[str, Footprint]:
            settle()
            # Counted twice a second apart: the actor probes Triton's health on fresh connections.
            actor_side = process_footprint(actor_pid, sockets_to=ports, steady_s=1.0)
            return {"actor": actor_side, "server": process_footprint(triton_pid, steady_s=1.0)}

        before = footprints()
        grant_cycles(cycles)
        lease_cycles(cycles * 4)
        after = footprints()
    for name in before:
        was, now = before[name], after[name]
        print(f"{name}: RSS {was.rss_kb} -> {now.rss_kb} kB, counted fds {len(was.fds)} -> {len(now.fds)}")
        assert_flat(name, before[name], after[name])
