"""Client helpers that need no server."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.core.slot_runs import chunks
from ray_triton_shm._private.shm.layout import ModelLayout
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm.client import InferResult
from ray_triton_shm.errors import TritonCallError, UnavailableError


def test_infer_result_pickles_with_path() -> None:
    result = InferResult({"OUTPUT0": np.arange(6, dtype=np.float32).reshape(2, 3)}, "shm")
    copy = pickle.loads(pickle.dumps(result))
    assert type(copy) is InferResult
    assert copy.path == "shm"
    assert list(copy) == ["OUTPUT0"]
    np.testing.assert_array_equal(copy["OUTPUT0"], result["OUTPUT0"])
    assert copy["OUTPUT0"].dtype == np.float32
    grpc = pickle.loads(pickle.dumps(InferResult({}, "grpc"), protocol=2))
    assert grpc.path == "grpc" and dict(grpc) == {}


def test_infer_result_is_a_dict_of_outputs_only() -> None:
    a = np.zeros(1)
    result = InferResult({"A": a}, "grpc")
    assert isinstance(result, dict)
    # The path is an attribute, never an output: code that iterates outputs does not see it.
    assert list(result.items()) == [("A", a)] and "path" not in result
    assert result == {"A": a} and result["A"] is a  # outputs are not copied on the way in
    assert dict(result) == {"A": a} and not hasattr(dict(result), "path")


def test_translate_unavailable() -> None:
    error = InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE")
    ours = translate_error(error, "identity")
    assert type(ours) is UnavailableError
    assert ours.status == "UNAVAILABLE"
    assert ours.model == "identity"
    assert ours.message == "failed to connect to all addresses"
    assert str(ours) == "[UNAVAILABLE] failed to connect to all addresses (model 'identity')"
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is UnavailableError and str(copy) == str(ours)


@pytest.mark.parametrize(
    ("status", "name"),
    [
        ("StatusCode.INVALID_ARGUMENT", "INVALID_ARGUMENT"),
        ("StatusCode.DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
        ("StatusCode.INTERNAL", "INTERNAL"),
        ("400", "400"),
    ],
)
def test_translate_other_errors(status: str, name: str) -> None:
    ours = translate_error(InferenceServerException("bad input", status=status))
    assert type(ours) is TritonCallError
    assert not isinstance(ours, UnavailableError)
    assert ours.status == name
    assert ours.model is None
    assert str(ours) == f"[{name}] bad input"


def test_translate_without_status() -> None:
    ours = translate_error(InferenceServerException("something"), "m")
    assert type(ours) is TritonCallError
    assert ours.status is None
    assert str(ours) == "something (model 'm')"


def test_chunks(identity_layout: ModelLayout, unbatched_layout: ModelLayout) -> None:
    # identity_layout holds 2 per slot.
    assert chunks(identity_layout, 1) == [(0, 1)]
    assert chunks(identity_layout, 2) == [(0, 2)]
    assert chunks(identity_layout, 5) == [(0, 2), (2, 4), (4, 5)]
    assert chunks(unbatched_layout, 1) == [(0, 1)]
