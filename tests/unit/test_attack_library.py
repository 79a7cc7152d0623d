"""The attack library's own pieces, without a server: the registry, the gap measure, the faults' bytes."""

from __future__ import annotations

import json

import hpack
import pytest

from ray_triton_shm._private.bench.attacks import ATTACKS, BY_NAME, CLASSES, faults, memory
from ray_triton_shm._private.bench.attacks.legit import Call, longest_gap


def test_every_attack_has_a_unique_name_a_class_and_a_protocol() -> None:
    assert len(BY_NAME) == len(ATTACKS)
    assert {a.kind for a in ATTACKS} == set(CLASSES)
    assert {a.protocol for a in ATTACKS} == {"http", "grpc"}
    assert all(a.summary for a in ATTACKS)


def test_the_longest_gap_counts_the_window_edges_and_only_right_answers() -> None:
    calls = [
        Call(protocol="http", start=0.0, end=1.0, ok=True),
        Call(protocol="http", start=1.0, end=2.0, ok=False, error="x"),
        Call(protocol="http", start=2.0, end=5.0, ok=True),
        Call(protocol="grpc", start=0.0, end=9.0, ok=True),
    ]
    assert longest_gap(calls, "http", 0.0, 6.0) == pytest.approx(4.0)
    assert longest_gap(calls, "http", 5.5, 6.0) == pytest.approx(0.5)
    assert longest_gap(calls, "grpc", 0.0, 6.0) == pytest.approx(6.0)


def test_each_fault_differs_from_a_valid_request_only_by_its_fault() -> None:
    for name, data in faults.FAULTS.items():
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v2/models/identity/infer HTTP/1.1\r\n"), name
        assert faults.BODY in body, name
    json.loads(faults.BODY)
    assert faults.refused("400") and faults.refused("closed") and faults.refused("501")
    assert not faults.refused("200") and not faults.refused("no answer")


def test_the_header_block_is_valid_hpack_of_the_size_asked() -> None:
    block = memory._literal_block(1 << 16)
    assert len(block) >= 1 << 16
    decoder = hpack.Decoder()
    decoder.max_header_list_size = 1 << 20
    headers = decoder.decode(block)
    assert headers[0][0] == "x-pad-0" and len(headers[0][1]) == 1000


def test_listening_pids_names_every_process_holding_a_shared_listening_socket() -> None:
    import os
    import socket
    import subprocess
    import sys

    from ray_triton_shm._private.bench.attacks.judge import listening_pids

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        holder = subprocess.Popen(  # another process holding the same socket, as a replica does
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            pass_fds=[s.fileno()],
        )
        try:
            assert listening_pids(port) == sorted([os.getpid(), holder.pid])
        finally:
            holder.kill()
            holder.wait()
    assert listening_pids(port) == []
