"""Device ids for CUDA pools: naming a client's GPU in the server's numbering.

``CUDA_VISIBLE_DEVICES`` renumbers GPUs per process: under Ray a task given
physical GPU 3 sees it as device 0. Triton must be told the id *it* sees,
so a client's device index is first turned into the GPU's identity (an entry
of the client's ``CUDA_VISIBLE_DEVICES``, or the index itself when the
variable is unset), then looked up in the server's numbering
(:func:`server_device_id`). Integer entries name GPUs in CUDA's enumeration
order, which is the same for both processes as long as they share
``CUDA_DEVICE_ORDER``; UUID (``GPU-...``) and MIG (``MIG-...``) entries are
compared as identities, and an index can be compared with a UUID only when
the GPUs' UUIDs are known (``physical_uuids``). Triton does not check the id
it is given (docs/cuda.md), so this mapping is the only safeguard.

The server's ``CUDA_VISIBLE_DEVICES`` is read from its process when not
given (:func:`server_visible_devices_of`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence

from ray_triton_shm.errors import DeviceMappingError

logger = logging.getLogger(__name__)

ALL_DEVICES = "all"
"""``server_visible_devices`` value meaning the server's ``CUDA_VISIBLE_DEVICES`` is unset."""

_INT_ENTRY = re.compile(r"^\d+$")


def parse_visible_devices(text: str | None) -> tuple[str, ...] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value exposes, in order.

    Follows CUDA: entries are comma separated, and parsing stops at the first
    entry that is not a non-negative index, a ``GPU-`` UUID or a ``MIG-``
    identifier (so ``"0,-1,1"`` exposes only GPU 0, and ``""`` none).
    Indices are normalised (``"01"`` becomes ``"1"``), UUIDs lower-cased.

    Args:
        text: The variable's value; ``None`` when it is unset.

    Returns:
        The entries, or ``None`` when unset (every GPU visible, in CUDA order).
    """
    if text is None:
        return None
    entries: list[str] = []
    for raw in text.split(","):
        entry = raw.strip()
        if _INT_ENTRY.match(entry):
            entries.append(str(int(entry)))
        elif entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
            entries.append(entry[:4].upper() + entry[4:].lower())
        else:
            break
    return tuple(entries)


def _canonical(entry: str, physical_uuids: Sequence[str] | None) -> str:
    """An entry as a full UUID when UUIDs are known and it names a whole GPU; else as it is."""
    if physical_uuids is None or entry.startswith("MIG-"):
        return entry
    uuids = [u.strip()[:4].upper() + u.strip()[4:].lower() for u in physical_uuids]
    if _INT_ENTRY.match(entry):
        index = int(entry)
        if index >= len(uuids):
            raise DeviceMappingError(f"GPU index {index} does not exist (the node has {len(uuids)} GPUs)")
        return uuids[index]
    # CUDA accepts any unique prefix of a UUID.
    matches = [u for u in uuids if u.startswith(entry)]
    if len(matches) != 1:
        raise DeviceMappingError(f"{entry!r} matches {len(matches)} of the node's GPUs {uuids}")
    return matches[0]


def server_device_id(
    client_index: int,
    client_visible: str | None,
    server_visible: str | None,
    *,
    physical_uuids: Sequence[str] | None = None,
) -> int:
    """The id Triton uses for the GPU a client calls ``client_index``.

    Args:
        client_index: Device index in the client process (after its renumbering).
        client_visible: The client's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        server_visible: The server's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        physical_uuids: UUIDs of the node's GPUs in CUDA order, when known; needed
            only to compare an index with a UUID.

    Returns:
        The device index in the server process.

    Raises:
        DeviceMappingError: The index is negative or not visible to the client,
            the server does not see that GPU, or index and UUID forms meet
            without ``physical_uuids``.
    """
    if isinstance(client_index, bool) or not isinstance(client_index, int) or client_index < 0:
        raise DeviceMappingError(f"client device index must be an int >= 0, got {client_index!r}")
    client = parse_visible_devices(client_visible)
    if client is None:
        identity = str(client_index)
    elif client_index < len(client):
        identity = client[client_index]
    else:
        raise DeviceMappingError(
            f"client device {client_index} is not visible: CUDA_VISIBLE_DEVICES={client_visible!r} "
            f"exposes {len(client)} GPU(s)"
        )
    server = parse_visible_devices(server_visible)
    want = _canonical(identity, physical_uuids)
    if server is None:
        if _INT_ENTRY.match(want):
            return int(want)
        if physical_uuids is not None and not want.startswith("MIG-"):
            return [_canonical(u, physical_uuids) for u in physical_uuids].index(want)
        raise DeviceMappingError(
            f"the client's GPU is {identity!r} and the server's CUDA_VISIBLE_DEVICES is unset: "
            "its index cannot be known without the node's GPU UUIDs"
            + ("" if not want.startswith("MIG-") else " (and a MIG device must be named to the server)")
        )
    candidates = [_canonical(entry, physical_uuids) for entry in server]
    if want in candidates:
        return candidates.index(want)
    if want.startswith("GPU-"):
        # CUDA takes any unique UUID prefix, so one side may name the GPU by a prefix of the other's.
        same = [
            i
            for i, c in enumerate(candidates)
            if c.startswith("GPU-") and (c.startswith(want) or want.startswith(c))
        ]
        if len(same) == 1:
            return same[0]
    kinds = {_INT_ENTRY.match(e) is not None for e in (want, *candidates)}
    hint = " (index and UUID forms cannot be compared without the GPU UUIDs)" if len(kinds) > 1 else ""
    raise DeviceMappingError(
        f"the client's GPU {identity!r} is not visible to the server "
        f"(server CUDA_VISIBLE_DEVICES={server_visible!r}){hint}"
    )


def local_device_index(
    server_device: int,
    local_visible: str | None,
    server_visible: str | None,
    local_count: int,
    *,
    local_uuids: Sequence[str] | None = None,
) -> int:
    """This process's index of the GPU the server calls ``server_device``.

    Every local index is tried in turn: an index the server cannot see (or
    that cannot be compared) is skipped rather than ending the search, so a
    server that sees only GPU 1 is still found at local index 1.

    Args:
        server_device: The GPU in the server's numbering.
        local_visible: This process's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        server_visible: The server's ``CUDA_VISIBLE_DEVICES`` (``None``: unset).
        local_count: How many GPUs this process sees.
        local_uuids: The UUIDs of this process's GPUs by local index, when
            known (:func:`local_device_uuids`): they let an index on one side
            be matched with a UUID on the other.

    Returns:
        The local device index.

    Raises:
        DeviceMappingError: No local GPU is the server's ``server_device``.
    """
    uuids = list(local_uuids) if local_uuids is not None and len(local_uuids) == local_count else None
    # Unset locally, the local GPUs are all of the node's GPUs in CUDA order.
    physical = uuids if uuids is not None and parse_visible_devices(local_visible) is None else None
    server = parse_visible_devices(server_visible)
    target = None if server is None or not 0 <= server_device < len(server) else server[server_device]
    reasons: list[str] = []
    for index in range(local_count):
        if uuids is not None and target is not None and target.startswith("GPU-"):
            if _canonical(uuids[index], None).startswith(target):
                return index
        try:
            if (
                server_device_id(index, local_visible, server_visible, physical_uuids=physical)
                == server_device
            ):
                return index
        except DeviceMappingError as e:
            reasons.append(f"local GPU {index}: {e}")
    raise DeviceMappingError(
        f"the server's GPU {server_device} is none of this process's {local_count} GPU(s) "
        f"(local CUDA_VISIBLE_DEVICES={local_visible!r}, server's {server_visible!r})"
        + (f"; {'; '.join(reasons)}" if reasons else "")
    )


UNKNOWN = object()
"""What :func:`detect_server_visible` answers when the server process cannot be found or read."""


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of TCP sockets listening on ``port`` (any address), from /proc/net."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def detect_server_visible(url: str) -> str | object | None:
    """The ``CUDA_VISIBLE_DEVICES`` of the local process listening on ``url``'s port.

    Reads the listener's environment from ``/proc`` (possible for a server
    of the same user, or as root, in the same PID namespace: not for a
    server in another container).

    Args:
        url: ``host:port`` of the server.

    Returns:
        The value, ``None`` when the server's variable is unset, or the
        sentinel ``UNKNOWN`` when the server process cannot be found or read.
    """
    try:
        port = int(url.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return UNKNOWN
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not sockets:
        return UNKNOWN
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            links = {os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)}
        except OSError:
            continue
        if not links & sockets:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            return UNKNOWN
        for entry in entries:
            name, _, value = entry.partition(b"=")
            if name == b"CUDA_VISIBLE_DEVICES":
                return value.decode(errors="replace")
        return None
    return UNKNOWN


def server_visible_devices_of(setting: str | None, url: str) -> str | None:
    """The server's ``CUDA_VISIBLE_DEVICES`` for a direct client (``ClientConfig.server_visible_devices``).

    Args:
        setting: :data:`ALL_DEVICES`: the server's is unset; another string:
            its value; ``None``: read it from the server process
            (:func:`detect_server_visible`).
        url: The server's ``host:port``.

    Raises:
        DeviceMappingError: ``setting`` is ``None`` and the server's
            environment cannot be read. Assuming the client's own would name
            the wrong GPU whenever the two differ (a Ray worker given GPU 3
            sees it as its device 0, a server that sees all GPUs calls it 3).
    """
    if setting == ALL_DEVICES:
        return None
    if setting is not None:
        return setting
    found = detect_server_visible(url)
    if found is UNKNOWN:
        raise DeviceMappingError(
            f"cannot tell which GPUs the server at {url} sees (its process environment is not "
            "readable from here): set ClientConfig.server_visible_devices (env "
            "RAY_TRITON_SHM_SERVER_VISIBLE_DEVICES) to its CUDA_VISIBLE_DEVICES, or 'all' if unset"
        )
    return found  # type: ignore[return-value]
