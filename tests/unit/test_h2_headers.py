from __future__ import annotations

import hpack
import pytest

from ray_triton_shm._private.serve.http2.h2_headers import (
    TABLE_SIZE_ZERO,
    HeaderDecoder,
    encode_block,
    leaves_table,
)

HEADERS = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-message", "x" * 300),  # a length past the 7-bit prefix
]


def test_encoded_blocks_read_back_and_leave_the_peers_table_empty() -> None:
    decoder = hpack.Decoder()
    for _ in range(2):
        assert decoder.decode(encode_block(HEADERS)) == HEADERS
    assert len(decoder.header_table.dynamic_entries) == 0
    assert encode_block(HEADERS) == encode_block(HEADERS)  # no state: the same bytes each time
    assert decoder.decode(TABLE_SIZE_ZERO + encode_block(HEADERS[:1])) == HEADERS[:1]
    assert decoder.header_table.maxsize == 0


def test_leaves_table_tells_indexed_blocks_from_those_that_add_entries() -> None:
    encoder = hpack.Encoder()
    path = "/inference.GRPCInferenceService/ModelInfer"
    request = [(":method", "POST"), (":path", path), ("te", "trailers")]
    first = encoder.encode(request)  # adds :path to the table
    second = encoder.encode(request)  # only indexed fields now
    assert not leaves_table(first)
    assert leaves_table(second)
    assert leaves_table(encode_block(HEADERS))
    assert not leaves_table(TABLE_SIZE_ZERO)
    assert not leaves_table(b"\x00\x05ab")  # a string past the end


def test_decoder_reuses_only_what_the_table_still_means() -> None:
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(1 << 20)
    a = [(":path", "/a"), ("x-key", "one")]
    b = [(":path", "/b"), ("x-key", "two")]
    got = [decoder.decode(encoder.encode(h)) for h in (a, a, a, b, b, a)]
    assert got == [a, a, a, b, b, a]
    # The same bytes (the dynamic table's first entry) after a block that changed the table:
    # decoded again, not taken from the last block.
    encoder, decoder = hpack.Encoder(), HeaderDecoder(1 << 20)
    first = [("x-a", "1")]
    decoder.decode(encoder.encode(first))  # adds x-a: 1 as entry 62
    assert decoder.decode(b"\xbe") == first
    assert decoder.decode(b"\xbe") == first
    decoder.decode(encoder.encode([("x-b", "2")]))  # x-b: 2 is entry 62 now
    assert decoder.decode(b"\xbe") == [("x-b", "2")]


def test_decoder_raises_on_garbage() -> None:
    with pytest.raises(Exception):  # noqa: B017 - hpack's own error classes
        HeaderDecoder(1 << 20).decode(b"\xff\xff\xff\xff\xff\xff")
