"""HTTP/2 header blocks (HPACK, RFC 7541) for the front door's gRPC server.

Answers are encoded without the dynamic table: every field is an indexed
static entry or a literal "without indexing", so the encoder keeps no state
and a block for fixed headers is the same bytes every time (built once).
Requests are decoded by ``hpack``; a block byte-for-byte the same as the
previous one, which changed nothing in the decoder's table, is not decoded
again (a client's repeated calls send the same block of indexed fields).
"""

from __future__ import annotations

from collections.abc import Sequence

import hpack

_STATUS_200 = b"\x88"  # the static table's entry 8, ":status: 200"
TABLE_SIZE_ZERO = b"\x20"
"""A dynamic table size update to 0: the first bytes of a block after the client sets its table size."""


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """``value`` as an HPACK integer with a ``prefix_bits`` prefix, ORed into ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return _integer(len(data), 7, 0) + data


def encode_block(headers: Sequence[tuple[str, str]]) -> bytes:
    """``headers`` as a header block that leaves the dynamic table as it is.

    ``:status: 200`` is the static entry; every other field is a literal
    without indexing, with its name as a literal too.
    """
    out = bytearray()
    for name, value in headers:
        if name == ":status" and value == "200":
            out += _STATUS_200
        else:
            out += b"\x00" + _string(name) + _string(value)
    return bytes(out)


class HeaderDecoder:
    """Decodes a connection's request header blocks, in order (``hpack`` keeps the dynamic table).

    Args:
        max_header_list_size: Largest decoded header list accepted.
    """

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = max_header_list_size
        self._last_block: bytes | None = None
        self._last_headers: list[tuple[str, str]] = []

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The headers of ``block`` (a list the caller must not change).

        Raises:
            Exception: ``hpack``'s errors, for a block it cannot read.
        """
        if block == self._last_block:
            return self._last_headers
        headers = [(str(k), str(v)) for k, v in self._decoder.decode(block)]
        if leaves_table(block):
            self._last_block, self._last_headers = block, headers
        else:
            self._last_block = None
        return headers


def leaves_table(block: bytes) -> bool:
    """Whether decoding ``block`` leaves the dynamic table as it was (no field added, no size update).

    A block that does not parse answers ``False`` (it is never reused).
    """
    pos, end = 0, len(block)
    try:
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # an indexed field
                pos = _skip_integer(block, pos, 7)
            elif byte & 0xC0 == 0x40 or byte & 0xE0 == 0x20:  # added to the table, or a size update
                return False
            else:  # a literal without indexing, or never indexed: 4-bit name index
                index, pos = _read_integer(block, pos, 4)
                if index == 0:
                    pos = _skip_string(block, pos)
                pos = _skip_string(block, pos)
    except IndexError:
        return False
    return pos == end


def _read_integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _skip_integer(block: bytes, pos: int, prefix_bits: int) -> int:
    return _read_integer(block, pos, prefix_bits)[1]


def _skip_string(block: bytes, pos: int) -> int:
    length, pos = _read_integer(block, pos, 7)
    if pos + length > len(block):
        raise IndexError("a string past the block's end")
    return pos + length
