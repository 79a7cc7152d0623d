"""A slot whose user died mid-request is not handed out while that request may still write to it."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient

from ray_triton_shm import PoolConfig, TritonServer
from ray_triton_shm._private.core.local_pools import fetch_layout
from ray_triton_shm._private.shm.segment import Segment, new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable

QUARANTINE_S = 0.5
REQUEST_TIMEOUT_S = 4.0  # longer than the quarantine, as by default (60 s against 30 s)
SLEEP_S = 2.5  # the request runs this long on the server
DIES_AFTER_S = 0.5  # the user dies while its request runs

# The user: shares the pool through the slot table (as a NodeClient does), sends a request that
# sleeps on the server, and dies (no cleanup) while it runs.
_USER = """
import os, sys, threading, time
import numpy as np
from ray_triton_shm import PoolConfig, TritonShmClient
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.shm.segment import Segment
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm._private.core.local_pools import fetch_layout
import tritonclient.grpc as grpcclient

url, data_name, table_name, timeout_s, sleep_s, dies_after_s, quarantine_s = sys.argv[1:8]


class Shared:
    def get_pool(self, model, config):
        layout = fetch_layout(grpcclient.InferenceServerClient(url), model, config)
        pool = SlotPool(Segment.attach(data_name), layout, [0], quarantine_s=float(quarantine_s))
        pool.share(SlotTable.attach(table_name))
        return pool

    def close(self):
        pass


client = TritonShmClient(url=url, pool_source=Shared(), request_timeout_s=float(timeout_s),
                         pools={"sleep": PoolConfig(slots=1)})
print(time.monotonic(), flush=True)
threading.Timer(float(dies_after_s), lambda: os._exit(0)).start()
client.infer("sleep", {"INPUT0": np.full((1, 1), float(sleep_s), np.float32)})
"""


def test_a_slot_is_not_reused_while_a_dead_users_request_may_still_write_it(
    triton_server: TritonServer,
) -> None:
    raw = grpcclient.InferenceServerClient(triton_server.grpc_url)
    layout = fetch_layout(raw, "sleep", PoolConfig(slots=1))
    data = Segment.create(new_segment_name("quartest"), layout.slot_bytes)
    table = SlotTable.create(new_segment_name("quartest"), slots=1, quarantine_s=QUARANTINE_S)
    raw.register_system_shared_memory(data.name, data.key, data.size)
    try:
        user = subprocess.run(
            [
                sys.executable,
                "-c",
                _USER,
                triton_server.grpc_url,
                data.name,
                table.name,
                str(REQUEST_TIMEOUT_S),
                str(SLEEP_S),
                str(DIES_AFTER_S),
                str(QUARANTINE_S),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert user.returncode == 0, user.stderr
        started = float(user.stdout.split()[0])
        # The next user takes the slot as soon as the table lets it.
        claimer = SlotTable.attach(table.name)
        while not claimer.try_claim(0):
            assert time.monotonic() < started + 30, "the slot never came back"
            time.sleep(0.02)
        claimed_after = time.monotonic() - started
        out = np.ndarray((1,), np.float32, buffer=data.mm, offset=layout.output("OUTPUT0").offset)
        out[:] = -1.0  # the new user's data
        time.sleep(max(0.0, started + SLEEP_S + 1.0 - time.monotonic()))  # past the dead user's request
        overwritten = float(out[0]) != -1.0
        del out
        claimer.release(0)
        claimer.close()
        assert not overwritten, (
            f"the slot was handed out {claimed_after:.2f} s after the request started, and the dead "
            f"user's request (still running {SLEEP_S} s, deadline {REQUEST_TIMEOUT_S} s) wrote into it"
        )
        assert claimed_after >= REQUEST_TIMEOUT_S + QUARANTINE_S, (
            f"handed out {claimed_after:.2f} s after a request with a {REQUEST_TIMEOUT_S} s deadline started"
        )
    finally:
        raw.unregister_system_shared_memory(data.name)
        raw.close()
        table.close()
        data.close()
