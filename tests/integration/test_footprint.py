"""The leak checks' own helper counts what it should: a socket to Triton's ports and every non-socket fd."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from .footprint import Footprint, assert_flat, process_footprint, triton_ports


def test_triton_ports_reads_both_url_forms() -> None:
    assert triton_ports("127.0.0.1:8001", "http://localhost:8000") == frozenset({8001, 8000})


def _sockets(footprint: Footprint) -> list[str]:
    """The counted sockets (other fds may open and close meanwhile: earlier tests' threads, GC)."""
    return sorted(fd for fd in footprint.fds if fd.startswith("socket:"))


def test_a_socket_counts_only_when_it_leads_to_the_given_ports() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        other_port = port + 1 if port < 65535 else port - 1
        before = process_footprint(os.getpid(), sockets_to=frozenset({port}))
        ignored_before = process_footprint(os.getpid(), sockets_to=frozenset({other_port}))
        with socket.create_connection(("127.0.0.1", port)) as conn, listener.accept()[0] as accepted:
            after = process_footprint(os.getpid(), sockets_to=frozenset({port}))
            ignored_after = process_footprint(os.getpid(), sockets_to=frozenset({other_port}))
            every_fd = process_footprint(os.getpid())
            inode = f"socket:[{os.fstat(conn.fileno()).st_ino}]"
            accepted_inode = f"socket:[{os.fstat(accepted.fileno()).st_ino}]"
    assert _sockets(before) == [] and _sockets(after) == [inode]
    # The accepted end's peer is the client's ephemeral port, so neither end counts here.
    assert _sockets(ignored_before) == _sockets(ignored_after) == []
    assert {inode, accepted_inode} <= set(every_fd.fds)
    grown = Footprint(rss_kb=before.rss_kb, fds=(*before.fds, inode))
    with pytest.raises(AssertionError, match="open fds grew from"):
        assert_flat("probe", before, grown)


def test_a_new_file_always_counts(tmp_path) -> None:
    before = process_footprint(os.getpid(), sockets_to=frozenset())
    with open(tmp_path / "held", "w"):
        after = process_footprint(os.getpid(), sockets_to=frozenset())
    assert str(tmp_path / "held") in after.fds
    # Judged against ``before`` plus that file alone: a thread of an earlier test closing an fd
    # meanwhile must not hide it.
    grown = Footprint(rss_kb=before.rss_kb, fds=(*before.fds, str(tmp_path / "held")))
    with pytest.raises(AssertionError, match=r"new: .*held"):
        assert_flat("probe", before, grown)
    assert_flat("same", before, Footprint(rss_kb=before.rss_kb, fds=before.fds))


def test_a_connection_that_closes_while_counting_is_not_a_leak_but_one_that_stays_is() -> None:
    # A health probe's connection lives milliseconds; counting at that moment must not read as a leak.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        ports = frozenset({port})
        before = process_footprint(os.getpid(), sockets_to=ports, steady_s=0.5)
        brief = socket.create_connection(("127.0.0.1", port))
        brief_inode = f"socket:[{os.fstat(brief.fileno()).st_ino}]"
        closer = threading.Timer(0.2, brief.close)
        closer.start()
        try:
            during = process_footprint(os.getpid(), sockets_to=ports, steady_s=0.5)
        finally:
            closer.cancel()
            brief.close()
        assert brief_inode not in during.fds
        assert_flat("brief", before, during)
        with socket.create_connection(("127.0.0.1", port)) as kept:
            after = process_footprint(os.getpid(), sockets_to=ports, steady_s=0.5)
            assert f"socket:[{os.fstat(kept.fileno()).st_ino}]" in after.fds
        with pytest.raises(AssertionError, match="open fds grew from"):
            assert_flat("kept", before, after)
