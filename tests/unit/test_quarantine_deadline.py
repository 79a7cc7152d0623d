"""The quarantine is a margin past the deadline of the last request on a slot, and never 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ray_triton_shm import ServerConfig
from ray_triton_shm._private.shm.segment import new_segment_name
from ray_triton_shm._private.shm.slot_table import SlotTable
from ray_triton_shm.errors import ConfigError

QUARANTINE_S = 0.3


@pytest.mark.parametrize("quarantine_s", [0, 0.0, -1.0, float("inf")])
def test_node_config_refuses_a_quarantine_that_is_no_margin(quarantine_s: float) -> None:
    from ray_triton_shm.node import NodeConfig

    with pytest.raises(ConfigError, match="quarantine_s"):
        NodeConfig(server=ServerConfig(model_repository="/models"), quarantine_s=quarantine_s)


def _dies_leasing(table_name: str, timeout_s: float | None) -> float:
    """A process leases slot 0, sends a request (deadline ``timeout_s``) if given, and dies."""
    request = f"t.request_started(0, {timeout_s!r})\n" if timeout_s is not None else ""
    code = (
        "import os, time\n"
        "from ray_triton_shm._private.shm.slot_table import SlotTable\n"
        f"t = SlotTable.attach({table_name!r})\n"
        "assert t.try_claim(0)\n" + request + "print(time.monotonic(), flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out)


def _claimed_after(table: SlotTable, since: float) -> float:
    while not table.try_claim(0):
        assert time.monotonic() < since + 30
        time.sleep(0.01)
    table.release(0)
    return time.monotonic() - since


@pytest.fixture
def table():
    owner = SlotTable.create(new_segment_name("deadline"), slots=1, quarantine_s=QUARANTINE_S)
    yield owner
    owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def test_a_dead_users_slot_waits_for_its_requests_deadline_plus_the_quarantine(table) -> None:
    started = _dies_leasing(table.name, 1.5)
    assert _claimed_after(table, started) >= 1.5 + QUARANTINE_S


def test_a_dead_user_without_a_request_is_held_the_quarantine_only(table) -> None:
    died = _dies_leasing(table.name, None)
    assert QUARANTINE_S <= _claimed_after(table, died) < 1.5


def test_an_answered_request_leaves_no_deadline_behind(table) -> None:
    user = SlotTable.attach(table.name)
    assert user.try_claim(0)
    user.request_started(0, 60.0)
    user.request_ended(0)
    user.release(0)
    assert table.try_claim(0)
    table.release(0)
    user.close()
