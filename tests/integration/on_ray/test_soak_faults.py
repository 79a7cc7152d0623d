"""The fault soak, one minute: 8 tritonclient processes through the front door while a Serve
replica, the node actor and the node's Triton are SIGKILLed once each (``make soak-faults``
runs it for 10 minutes).

Every answer must be correct or an error in Triton's shape, the app must recover from each
fault on both protocols, every slot must come back, and nothing of the run may outlive it.
``RAY_TRITON_SHM_SOAK_FAULTS_S`` sets the least run time (default 60 s).
"""

from __future__ import annotations

import os

import pytest
import yaml

from ray_triton_shm._private.cli.soak_faults import FAULTS, MARK_ENV, front_door, run_fault_soak

from .conftest import config_copy

pytestmark = pytest.mark.slow

DURATION_S = float(os.environ.get("RAY_TRITON_SHM_SOAK_FAULTS_S", "60"))


def test_front_door_under_faults(tmp_path):
    # The shipped config on free ports, with only the models called (each Triton restart
    # loads them again) and a short slot quarantine (slots of killed requests come back).
    path, _ = config_copy(
        tmp_path,
        quarantine_s=2.0,
        server={"load_models": ["add_sub", "identity"]},
        pools={
            "add_sub": {"slots": 8},
            "identity": {"slots": 8, "max_batch_size": 1, "max_shapes": {"INPUT0": [262144]}},
        },
    )
    door = front_door(str(path))
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    ports = (args["frontdoor"]["http_port"], args["frontdoor"]["grpc_port"])
    assert (door.http_port, door.grpc_port) == ports

    report = run_fault_soak(str(path), duration_s=DURATION_S, callers=8)
    summary = report.summary()
    print(summary)

    assert MARK_ENV not in os.environ
    assert len(report.callers) == 8, summary
    assert {c["protocol"] for c in report.callers} == {"http", "grpc"}
    assert report.total("wrong") == 0, summary
    assert [f.target for f in report.faults] == list(FAULTS), summary
    for fault in report.faults:
        assert fault.injected_at is not None and fault.gone, summary
        assert fault.replaced_by not in (None, fault.pid), summary
        assert fault.recovered_at is not None, summary
    assert [w.label for w in report.windows] == ["before the faults"] + [
        f"after the {f} fault" for f in FAULTS
    ]
    for window in report.windows:
        assert window.correct.get("http", 0) > 0 and window.correct.get("grpc", 0) > 0, summary
    assert report.slots_not_returned == {}, summary
    assert report.leftover_segments == [], summary
    assert report.leftover_processes == [], summary
    assert report.problems == [], summary
