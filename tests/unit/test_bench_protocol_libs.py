"""The protocol-library comparison runs end to end (every variant answers real callers) and reports."""

from __future__ import annotations

import h11
import pytest

from ray_triton_shm._private.bench import protocol_libs
from ray_triton_shm._private.bench.protocol_variants import parse_head_h11
from ray_triton_shm._private.serve.http1.head import HttpParseError, parse_head_by_hand

pytestmark = pytest.mark.slow


def test_every_variant_echoes_through_its_slots_and_the_table_compares_them() -> None:
    result = protocol_libs.run(64 * 1024, 2, 2, 0.3)
    for name in protocol_libs.VARIANTS:
        variant = result["variants"][name]
        assert len(variant["rounds"]) == 2 and all(r["calls"] > 0 for r in variant["rounds"]), name
    pairs = {(c["ours"], c["library"]) for c in result["comparisons"]}
    assert pairs == set(protocol_libs.PAIRS)
    table = protocol_libs.table(result)
    assert "http1-httptools vs http1-ours" in table and "grpc-h2 vs grpc-ours" in table
    assert set(result["head_us"]) == {"http1-ours", "http1-httptools", "http1-h11"}


def test_the_h11_variant_keeps_the_checks_on_top() -> None:
    head = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n"
    assert parse_head_h11(head) == parse_head_by_hand(head)
    for bad, message in (
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", "folding"),  # h11 unfolds it
        (b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", "malformed request head"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "malformed request head"),
    ):
        try:
            parse_head_h11(bad)
        except HttpParseError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    assert h11.PRODUCT_ID
