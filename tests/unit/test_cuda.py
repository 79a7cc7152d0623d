"""CUDA plumbing that needs no GPU: device-id mapping, config, handle encoding, the missing-cupy error."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from ray_triton_shm._private.shm import cuda, cuda_devices
from ray_triton_shm._private.shm.cuda_devices import parse_visible_devices, server_device_id
from ray_triton_shm._private.shm.layout import layout_from_config
from ray_triton_shm._private.shm.validate import check_inputs
from ray_triton_shm.config import ClientConfig, PoolConfig
from ray_triton_shm.errors import (
    ConfigError,
    CudaError,
    CudaUnavailableError,
    DeviceMappingError,
    RayTritonShmError,
)

UUIDS = (
    "GPU-aaaaaaaa-1111-2222-3333-444444444444",
    "GPU-bbbbbbbb-1111-2222-3333-444444444444",
    "GPU-cccccccc-1111-2222-3333-444444444444",
    "GPU-ccdddddd-1111-2222-3333-444444444444",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RAY_TRITON_SHM_"):
            monkeypatch.delenv(name)


# -- CUDA_VISIBLE_DEVICES parsing ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, None),
        ("", ()),
        ("0", ("0",)),
        ("3,1", ("3", "1")),
        (" 2 , 01 ", ("2", "1")),
        ("0,-1,1", ("0",)),  # CUDA stops at the first invalid entry
        ("-1", ()),
        ("0,,1", ("0",)),
        ("NoDevFiles", ()),
        ("GPU-AbC,1", ("GPU-abc", "1")),
        ("gpu-abc", ("GPU-abc",)),
        ("MIG-GPU-abc/1/0", ("MIG-gpu-abc/1/0",)),
        ("GPU-", ()),
    ],
)
def test_parse_visible_devices(text: str | None, expected: tuple[str, ...] | None) -> None:
    assert parse_visible_devices(text) == expected


# -- mapping a client's device to the server's numbering ---------------------------------


@pytest.mark.parametrize(
    ("index", "client", "server", "expected"),
    [
        (0, None, None, 0),  # nobody renumbers
        (2, None, None, 2),
        (0, "3", None, 3),  # Ray gave the client GPU 3; Triton sees every GPU
        (1, "2,3", None, 3),
        (0, "3", "2,3", 1),  # Triton itself sees only GPUs 2 and 3
        (0, "3", "3,2", 0),
        (0, None, "1,0", 1),  # client unset: its index is the physical one
        (0, "03", "3", 0),
        (1, "1,2,-1,0", "0,1,2", 2),
        (0, "GPU-bbbbbbbb-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444", 0),
        (0, "MIG-abc/1/0", "MIG-xyz/2/0,MIG-abc/1/0", 1),
        (0, "GPU-bbbbbbbb", "GPU-aaaaaaaa,GPU-bbbbbbbb-1111-2222-3333-444444444444", 1),  # a prefix
        (0, "GPU-bbbbbbbb-1111-2222-3333-444444444444", "GPU-bbbb", 0),
    ],
)
def test_server_device_id(index: int, client: str | None, server: str | None, expected: int) -> None:
    assert server_device_id(index, client, server) == expected


@pytest.mark.parametrize(
    ("index", "client", "server", "expected"),
    [
        (0, "GPU-bbbbbbbb-1111-2222-3333-444444444444", None, 1),
        (0, "GPU-bbbbbbbb", None, 1),  # unique prefix, as CUDA accepts
        (0, "GPU-BBBBBBBB", "2,1", 1),
        (0, "2", "GPU-cccccccc-1111-2222-3333-444444444444", 0),
        (1, "0,3", "GPU-aaaaaaaa,GPU-ccdddddd", 1),
    ],
)
def test_server_device_id_mixing_uuids_and_indices(
    index: int, client: str, server: str | None, expected: int
) -> None:
    assert server_device_id(index, client, server, physical_uuids=UUIDS) == expected


@pytest.mark.parametrize(
    ("index", "client", "server", "uuids", "match"),
    [
        (1, "3", None, None, "not visible"),
        (0, "", None, None, "not visible"),
        (1, "0,-1,1", None, None, "not visible"),
        (0, "3", "0,1", None, "not visible to the server"),
        (0, "3", "", None, "not visible to the server"),
        (0, "GPU-bbbbbbbb", None, None, "UUIDs"),
        (0, "GPU-bbbbbbbb", "1", None, "cannot be compared"),
        (0, "1", "GPU-bbbbbbbb", None, "cannot be compared"),
        (0, "MIG-abc/1/0", None, None, "MIG"),
        (0, "MIG-abc/1/0", None, UUIDS, "MIG"),
        (0, "GPU-cc", None, UUIDS, "matches 2"),
        (0, "GPU-ff", None, UUIDS, "matches 0"),
        (0, "7", None, UUIDS, "does not exist"),
        (-1, None, None, None, ">= 0"),
    ],
)
def test_server_device_id_errors(
    index: int, client: str | None, server: str | None, uuids: tuple[str, ...] | None, match: str
) -> None:
    with pytest.raises(DeviceMappingError, match=match):
        server_device_id(index, client, server, physical_uuids=uuids)


@pytest.mark.parametrize("bad", [True, 1.0, "0", None])
def test_server_device_id_rejects_non_int_index(bad: object) -> None:
    with pytest.raises(DeviceMappingError):
        server_device_id(bad, None, None)  # type: ignore[arg-type]


def test_device_mapping_error_is_a_value_error_and_a_cuda_error() -> None:
    with pytest.raises(ValueError):
        server_device_id(5, "0", None)
    assert issubclass(DeviceMappingError, CudaError)
    assert issubclass(CudaError, RayTritonShmError)


def _listener(env_value: str | None) -> tuple[subprocess.Popen[str], str]:
    """A process listening on a free port, with CUDA_VISIBLE_DEVICES set (or unset): a stand-in server."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if env_value is not None:
        env["CUDA_VISIBLE_DEVICES"] = env_value
    code = (
        "import socket, sys\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, f"127.0.0.1:{proc.stdout.readline().strip()}"


@pytest.mark.parametrize("value", ["2,3", "", None])
def test_server_visible_devices_are_read_from_the_server_process(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the client's own is not the server's
    proc, url = _listener(value)
    try:
        assert cuda_devices.detect_server_visible(url) == value
        assert cuda_devices.server_visible_devices_of(None, url) == value
        assert cuda_devices.server_visible_devices_of("all", url) is None  # explicit wins
        assert cuda_devices.server_visible_devices_of("1", url) == "1"
        # A Ray worker given GPU 3 (its device 0) against a server that sees every GPU: Triton's 3.
        if value is None:
            assert server_device_id(0, "3", cuda_devices.server_visible_devices_of(None, url)) == 3
    finally:
        proc.communicate("", timeout=30)
    assert cuda_devices.detect_server_visible(url) is cuda_devices.UNKNOWN  # nobody listens any more
    with pytest.raises(DeviceMappingError, match="server_visible_devices"):
        cuda_devices.server_visible_devices_of(None, url)
    assert cuda_devices.server_visible_devices_of("all", url) is None


# -- IPC handle encoding -------------------------------------------------------------------


def test_encode_handle_is_what_tritonclient_decodes() -> None:
    raw = bytes(range(64))
    encoded = cuda.encode_handle(raw)
    assert base64.b64decode(encoded) == raw  # tritonclient's grpc client b64-decodes raw_handle
    with pytest.raises(CudaError, match="64 bytes"):
        cuda.encode_handle(raw[:63])


# -- recognising device arrays without cupy ---------------------------------------------


class _FakeDLPack:
    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, 0)

    def __dlpack__(self, stream: object = None) -> object:
        raise AssertionError("not converted in these tests")


class _FakeCudaArray:
    shape = (1, 4)
    __cuda_array_interface__ = {"shape": (1, 4), "typestr": "<f4", "data": (0, False), "version": 3}


def test_is_device_array() -> None:
    assert not cuda.is_device_array(np.zeros(3))
    assert not cuda.is_device_array([1, 2])
    assert not cuda.is_device_array(_FakeDLPack(1))  # kDLCPU
    assert cuda.is_device_array(_FakeDLPack(2))  # kDLCUDA
    assert cuda.is_device_array(_FakeCudaArray())


# -- cupy missing: the typed error, for real ------------------------------------------------


def test_import_cupy_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(CudaUnavailableError, match=r"ray-triton-shm\[cuda\]") as info:
        cuda.import_cupy()
    assert isinstance(info.value.__cause__, ImportError)
    assert isinstance(info.value, ImportError)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is CudaUnavailableError and str(copy) == str(info.value)


def test_cuda_pool_create_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_triton_shm._private.shm.cuda_pool import CudaSlotPool

    monkeypatch.setitem(sys.modules, "cupy", None)
    layout = layout_from_config(_IDENTITY_CONFIG, PoolConfig(max_shapes={"INPUT0": (4,), "OUTPUT0": (4,)}))
    with pytest.raises(CudaUnavailableError):
        CudaSlotPool.create(layout, 2)


def test_device_input_without_cupy_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    layout = layout_from_config(_IDENTITY_CONFIG, PoolConfig(max_shapes={"INPUT0": (4,), "OUTPUT0": (4,)}))
    with pytest.raises(CudaUnavailableError):
        check_inputs(layout, {"INPUT0": _FakeDLPack(2)})


def test_missing_cupy_in_a_fresh_interpreter() -> None:
    """Nothing is imported at package import time that needs cupy; asking for CUDA says what to install."""
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import ray_triton_shm, ray_triton_shm.client\n"
        "from ray_triton_shm._private.shm.cuda import import_cupy\n"
        "from ray_triton_shm.errors import CudaUnavailableError\n"
        "try:\n    import_cupy()\nexcept CudaUnavailableError as e:\n    print('OK', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK") and "ray-triton-shm[cuda]" in done.stdout


_IDENTITY_CONFIG = {
    "name": "identity",
    "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["-1"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["-1"]}],
}


# -- configuration -----------------------------------------------------------------------


def test_pool_config_memory_defaults_and_validation() -> None:
    assert PoolConfig().memory == "system" and PoolConfig().device_id is None
    config = PoolConfig(memory="cuda", device_id=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.memory = "system"  # type: ignore[misc]
    for bad in ({"memory": "gpu"}, {"memory": ""}, {"memory": "CUDA"}):
        with pytest.raises(ConfigError, match="memory"):
            PoolConfig(**bad)
    for bad_id in (-1, True, 1.5, "0"):
        with pytest.raises(ConfigError, match="device_id"):
            PoolConfig(memory="cuda", device_id=bad_id)  # type: ignore[arg-type]


def test_pool_config_memory_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_MEMORY", "cuda")
    monkeypatch.setenv("RAY_TRITON_SHM_DEVICE_ID", "2")
    config = PoolConfig()
    assert (config.memory, config.device_id) == ("cuda", 2)
    assert PoolConfig(memory="system").memory == "system"  # explicit beats the environment
    monkeypatch.setenv("RAY_TRITON_SHM_DEVICE_ID", "two")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_DEVICE_ID"):
        PoolConfig()
    monkeypatch.setenv("RAY_TRITON_SHM_DEVICE_ID", "")
    assert PoolConfig().device_id is None
    monkeypatch.setenv("RAY_TRITON_SHM_MEMORY", "tpu")
    with pytest.raises(ConfigError, match="memory"):
        PoolConfig()


def test_cuda_configs_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_SERVER_VISIBLE_DEVICES", "all")
    client = ClientConfig(pools={"identity": PoolConfig(memory="cuda", device_id=0)})
    assert client.server_visible_devices == "all"
    copy = pickle.loads(pickle.dumps(client))
    assert copy == client and copy.pools["identity"].memory == "cuda"
    with pytest.raises(ConfigError, match="server_visible_devices"):
        ClientConfig(server_visible_devices=3)  # type: ignore[arg-type]


# -- the node actor's index of Triton's GPU -----------------------------------------------


@pytest.mark.parametrize(
    ("server_device", "local", "server", "count", "expected"),
    [
        (0, None, "1", 2, 1),  # ServerConfig.gpus=(1,): local GPU 0 is not Triton's; keep looking
        (1, None, "0,2", 3, 2),
        (0, "2,3", "3", 2, 1),
        (2, None, None, 3, 2),
        (0, "GPU-bbbbbbbb", "GPU-bbbbbbbb-1111-2222-3333-444444444444", 1, 0),
    ],
)
def test_local_device_index(
    server_device: int, local: str | None, server: str | None, count: int, expected: int
) -> None:
    assert cuda_devices.local_device_index(server_device, local, server, count) == expected


def test_local_device_index_matches_uuids_with_indices() -> None:
    local_uuids = [UUIDS[1], UUIDS[2]]
    # The actor sees GPUs 1 and 2 by index, Triton was told a UUID: matched through the local UUIDs.
    assert cuda_devices.local_device_index(0, "1,2", UUIDS[2][:12], 2, local_uuids=local_uuids) == 1
    # The actor sees every GPU (unset): its UUIDs are the node's, so an index meets a UUID.
    assert cuda_devices.local_device_index(0, None, "GPU-cccccccc", 4, local_uuids=list(UUIDS)) == 2


def test_local_device_index_errors_say_why() -> None:
    with pytest.raises(DeviceMappingError, match="none of this process's 2 GPU") as info:
        cuda_devices.local_device_index(0, None, "5", 2)
    assert "local GPU 0" in str(info.value) and "local GPU 1" in str(info.value)
    with pytest.raises(DeviceMappingError, match="cannot be compared"):
        # The actor names its GPUs by UUID, Triton by index, and the node's UUIDs are unknown.
        cuda_devices.local_device_index(0, "GPU-aaaaaaaa", "0", 1, local_uuids=None)
