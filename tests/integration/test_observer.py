"""The client reports requests, bytes, lease waits and errors to its observer (real Triton, no Ray)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ray_triton_shm import InputError, PoolConfig, TritonCallError


class Recorder:
    """An observer that keeps every event."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, int]] = []
        self.waits: list[tuple[str, float]] = []
        self.errors: Counter[tuple[str, str]] = Counter()

    def request(self, model: str, path: str, nbytes: int, seconds: float) -> None:
        assert seconds >= 0
        self.requests.append((model, path, nbytes))

    def lease_wait(self, model: str, seconds: float) -> None:
        self.waits.append((model, seconds))

    def error(self, model: str, kind: str) -> None:
        self.errors[(model, kind)] += 1


def test_observer_sees_each_request_path_bytes_and_errors(make_client) -> None:
    recorder = Recorder()
    client = make_client(
        observer=recorder,
        pools={"add_sub": PoolConfig(slots=2, max_batch_size=4), "always_fails": PoolConfig(slots=1)},
    )
    a = np.arange(6 * 16, dtype=np.int32).reshape(6, 16)  # 6 rows: two slot-sized chunks of 4 and 2
    client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    client.infer_grpc("add_sub", {"INPUT0": a[:1], "INPUT1": a[:1]})
    with pytest.raises(InputError):
        client.infer("add_sub", {"INPUT0": a.astype(np.float32), "INPUT1": a})
    with pytest.raises(TritonCallError):
        client.infer("always_fails", {"INPUT0": np.ones((1, 4), np.float32)})

    row = 16 * 4  # one int32 row of one tensor
    assert sorted(recorder.requests) == sorted(
        [
            ("add_sub", "shm", 4 * 4 * row),  # chunk of 4 rows: 2 inputs + 2 outputs
            ("add_sub", "shm", 4 * 2 * row),  # chunk of 2 rows
            ("add_sub", "grpc", 4 * 1 * row),
        ]
    )
    assert [m for m, _ in recorder.waits] == ["add_sub", "add_sub", "always_fails"]
    assert recorder.errors == Counter({("add_sub", "InputError"): 1, ("always_fails", "TritonCallError"): 1})


def test_small_requests_fall_back_to_grpc_and_say_so(make_client) -> None:
    recorder = Recorder()
    client = make_client(observer=recorder, pools={"add_sub": PoolConfig(slots=1, min_shm_bytes=1 << 20)})
    a = np.ones((1, 16), np.int32)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
    assert out.path == "grpc"
    assert recorder.requests == [("add_sub", "grpc", 4 * 16 * 4)]
    assert recorder.waits == []
