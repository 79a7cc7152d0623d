from __future__ import annotations

import pickle

import pytest

import ray_triton_shm
from ray_triton_shm import errors

# Plausible constructor arguments per class; every class in __all__ must be here.
ARGS: dict[str, tuple] = {
    "RayTritonShmError": ("something failed",),
    "ConfigError": ("PoolConfig.slots must be >= 1, got 0",),
    "CudaError": ("cudaMalloc of 4096 bytes on GPU 0 failed",),
    "CudaUnavailableError": ("CUDA shared memory needs cupy; pip install 'ray-triton-shm[cuda]'",),
    "DeviceMappingError": ("the client's GPU '3' is not visible to the server",),
    "NoGpuError": ("this process sees no GPU",),
    "FrontDoorError": ("cannot listen for HTTP on 127.0.0.1:8000: address in use",),
    "InputError": ("INPUT0: expected dtype FP32 (float32), got INT64 (int64)",),
    "RequestTooLargeError": ("request body of 99 bytes exceeds the maximum allowed size of 64 bytes",),
    "LayoutError": ("model 'strings' tensor 'TEXT' is BYTES/STRING",),
    "LayoutMismatchError": ("add_sub", "0123456789abcdef", "fedcba9876543210"),
    "LeaseReleasedError": ("this lease was released",),
    "PoolClosedError": ("pool of 'identity' is closed",),
    "PoolTimeoutError": ("identity", 0.25, "of 1 slots: 1 in use by this process"),
    "ServerError": ("tritonserver exited with code 1",),
    "ServerNotFoundError": ("no tritonserver binary found",),
    "ServerStartError": ("tritonserver did not become ready in 5 s", "E0101 line one\nE0101 line two"),
    "SharedMemoryError": ("/dev/shm has too little space",),
    "SlotRefError": ("SlotRef slot must be >= 0, got -1",),
    "StaleSlotRefError": ("slot 2 of 'identity' is not held by the lease of pid 42",),
    "SlotRefElsewhereError": ("a slot reference of node a reached node b",),
    "TritonCallError": ("unexpected shape for input 'INPUT0'", "INVALID_ARGUMENT", "identity"),
    "UnavailableError": ("failed to connect to all addresses", "UNAVAILABLE", "add_sub"),
    "OutputTooLargeError": ("output 'OUTPUT0' should be at least 400 bytes", "INTERNAL", "identity"),
    "RefusedError": ("ModelStreamInfer is not supported by this endpoint", "UNIMPLEMENTED"),
    "SharedMemoryRefusedError": ("system shared-memory registration is not supported", "UNIMPLEMENTED"),
    "OverloadedError": (32,),
    "ModelControlRefusedError": ("cannot load model 'simple': no explicit model control", "UNAVAILABLE"),
    "SettingsRefusedError": ("changing log settings is not supported by this endpoint", "UNIMPLEMENTED"),
}

ATTRS: dict[str, tuple[str, ...]] = {
    "PoolTimeoutError": ("model", "timeout_s", "detail"),
    "LayoutMismatchError": ("model", "layout_fingerprint", "server_fingerprint"),
    "ServerStartError": ("message", "log_tail"),
    "TritonCallError": ("message", "status", "model"),
    "UnavailableError": ("message", "status", "model"),
    "OutputTooLargeError": ("message", "status", "model"),
    "RefusedError": ("message", "status"),
    "SharedMemoryRefusedError": ("message", "status"),
    "OverloadedError": ("limit", "message", "status"),
    "ModelControlRefusedError": ("message", "status"),
    "SettingsRefusedError": ("message", "status"),
}


def test_every_exported_error_has_test_arguments() -> None:
    assert set(ARGS) == set(errors.__all__)


@pytest.mark.parametrize("name", errors.__all__)
def test_pickle_round_trip(name: str) -> None:
    cls = getattr(errors, name)
    err = cls(*ARGS[name])
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is cls
    assert str(copy) == str(err)
    assert copy.args == err.args
    for attr in ATTRS.get(name, ()):
        assert getattr(copy, attr) == getattr(err, attr)


@pytest.mark.parametrize("name", errors.__all__)
def test_pickle_round_trip_keeps_cause_chain_usable(name: str) -> None:
    """Raising, catching and pickling (what Ray does with task errors) works for each class."""
    cls = getattr(errors, name)
    root = OSError("the underlying failure")
    try:
        try:
            raise root
        except OSError as e:
            raise cls(*ARGS[name]) from e
    except errors.RayTritonShmError as e:
        caught = e
    assert caught.__cause__ is root  # `raise ... from e` keeps the cause for the traceback
    copy = pickle.loads(pickle.dumps(caught))
    assert type(copy) is cls and copy.args == caught.args
    # Pickle drops __cause__ (Ray sends the traceback text instead); the copy chains again.
    assert copy.__cause__ is None
    try:
        raise copy from root
    except errors.RayTritonShmError as again:
        assert again.__cause__ is root and str(again) == str(caught)


@pytest.mark.parametrize("name", errors.__all__)
def test_all_derive_from_root(name: str) -> None:
    assert issubclass(getattr(errors, name), errors.RayTritonShmError)
    assert name in ray_triton_shm.__all__


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.PoolTimeoutError, TimeoutError),
        (errors.InputError, ValueError),
        (errors.ConfigError, ValueError),
        (errors.LayoutError, ValueError),
        (errors.ServerNotFoundError, FileNotFoundError),
        (errors.ServerNotFoundError, errors.ServerError),
        (errors.ServerStartError, errors.ServerError),
        (errors.SharedMemoryError, OSError),
        (errors.UnavailableError, errors.TritonCallError),
        (errors.OutputTooLargeError, errors.TritonCallError),
        (errors.PoolClosedError, RuntimeError),
        (errors.LeaseReleasedError, RuntimeError),
    ],
)
def test_hierarchy(cls: type, builtin: type) -> None:
    assert issubclass(cls, builtin)


def test_pool_timeout_message() -> None:
    err = errors.PoolTimeoutError("identity", 0.25)
    assert err.model == "identity"
    assert err.timeout_s == 0.25
    assert "'identity'" in str(err) and "0.25 s" in str(err)
    with pytest.raises(TimeoutError):
        raise err


def test_server_start_error_message() -> None:
    assert str(errors.ServerStartError("did not start")) == "did not start"
    with_tail = str(errors.ServerStartError("did not start", "last line"))
    assert with_tail.startswith("did not start\n")
    assert with_tail.endswith("last line")


def test_triton_call_error_message() -> None:
    assert str(errors.TritonCallError("boom")) == "boom"
    assert str(errors.TritonCallError("boom", "INTERNAL", "m")) == "[INTERNAL] boom (model 'm')"
    err = errors.UnavailableError("gone", "UNAVAILABLE")
    assert err.model is None and err.status == "UNAVAILABLE"
