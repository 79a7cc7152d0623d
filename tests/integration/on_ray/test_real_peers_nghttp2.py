"""The real gRPC peers of ``test_real_peers`` against a front door whose gRPC is served by nghttp2.

The same app (``grpc_engine: nghttp2``), the same unchanged programs and checks: tritonclient's
gRPC clients, grpcio with large calls at once on one channel, ``h2load``, ``nghttp``, ``curl
--http2-prior-knowledge`` and the frame-by-frame client. One answer differs, as RFC 9113 allows
(section 5.4: a stream error may be treated as a connection error): nghttp2 ends the connection
for a zero window increment on a stream, where the Python engine resets only that stream.
"""

from __future__ import annotations

import numpy as np
import pytest

from ray_triton_shm._private.bench.attacks.wire import grpc_framed
from ray_triton_shm._private.bench.attacks.wire import identity_message as identity_request

from . import test_real_peers
from .real_peers import (
    DATA,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    MODEL_INFER,
    PROTOCOL_ERROR,
    RST_STREAM,
    SERVER_LIVE,
    RawH2,
    ended,
    grpc_unframed,
    identity_output,
    no_slot_held,
    random_rows,
    reset_code,
    serve_door,
    stream_frames,
)
from .test_real_peers import (  # collected here again, with this module's door
    test_an_initial_window_setting_past_the_maximum_ends_the_connection,
    test_answers_keep_exactly_within_the_clients_windows,
    test_connection_window_updates_of_zero_or_past_the_maximum_end_the_connection,
    test_curl_http2_prior_knowledge_model_infer_and_server_live,
    test_grpcio_large_calls_at_once_on_one_channel_each_get_their_answer,
    test_h2load_many_large_calls_at_once_all_succeed,
    test_nghttp_model_infer_and_server_live,
    test_tritonclient_classification_is_refused_not_answered_with_the_whole_tensor,
    test_tritonclient_grpc_sync_async_and_aio_clients_get_their_inputs_back,
)

__all__ = [
    "test_an_initial_window_setting_past_the_maximum_ends_the_connection",
    "test_answers_keep_exactly_within_the_clients_windows",
    "test_connection_window_updates_of_zero_or_past_the_maximum_end_the_connection",
    "test_curl_http2_prior_knowledge_model_infer_and_server_live",
    "test_grpcio_large_calls_at_once_on_one_channel_each_get_their_answer",
    "test_h2load_many_large_calls_at_once_all_succeed",
    "test_nghttp_model_infer_and_server_live",
    "test_tritonclient_classification_is_refused_not_answered_with_the_whole_tensor",
    "test_tritonclient_grpc_sync_async_and_aio_clients_get_their_inputs_back",
]

MB = 262144  # FP32 elements in 1 MiB


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """The app's front door, its gRPC served by nghttp2, and its node's Triton."""
    with serve_door(tmp_path_factory.mktemp("peers-nghttp2"), grpc_engine="nghttp2") as where:
        yield where


def test_the_replica_serves_grpc_with_nghttp2(door) -> None:
    """The replica runs the engine (its library is mapped), so the peers here met nghttp2."""
    with open(f"/proc/{door['where']['pid']}/maps") as maps:
        mapped = maps.read()
    assert "_h2_engine" in mapped and "libnghttp2" in mapped


def test_a_stream_window_past_the_maximum_resets_that_stream_and_a_zero_increment_ends_the_connection(
    door,
) -> None:
    """RFC 9113 6.9: a stream window past 2^31-1 resets that stream (FLOW_CONTROL_ERROR) and the
    connection goes on; a zero increment on a stream ends the connection (PROTOCOL_ERROR, a stream
    error treated as a connection error, 5.4). The calls' slots come back either way."""
    x = random_rows([MB], seed=10)[0]
    framed = grpc_framed(identity_request(x))
    half = len(framed) // 2
    with RawH2(door["grpc"]) as h2:
        h2.request(1, MODEL_INFER, framed[:half], end=False)  # a call still arriving (into a slot)
        h2.window_update(1, MAX_WINDOW - 65535)  # the stream's window: exactly 2^31-1
        assert reset_code(h2.confirmed_quiet(), 1) is None
        h2.window_update(1, 1)
        frames = h2.until(lambda f: reset_code(f, 1) is not None)
        assert reset_code(frames, 1) == FLOW_CONTROL_ERROR
        h2.data(1, framed[half:])  # after the reset: ignored
        h2.request(3, MODEL_INFER, framed)
        h2.request(5, SERVER_LIVE, grpc_framed(b""))
        frames = h2.until(lambda frames: ended(frames, (3, 5)))
        assert not any(k in (RST_STREAM, GOAWAY) for k, _, _, _ in frames)
        blocks = {s: h2.decode(p) for k, _, s, p in frames if k == HEADERS and p}
        body = b"".join(payload for _, payload in stream_frames(frames, 3, DATA))
    assert np.array_equal(identity_output(grpc_unframed(body)), x)
    for stream in (3, 5):
        assert blocks[stream]["grpc-status"] == "0", blocks[stream]
    with RawH2(door["grpc"]) as h2:
        h2.request(1, MODEL_INFER, framed[:half], end=False)
        h2.window_update(1, 0)
        assert h2.goaway()[1] == PROTOCOL_ERROR
    assert no_slot_held()


def test_after_shutdown_nothing_listens_and_nothing_is_left(door) -> None:
    """Last in this module (see ``test_real_peers``)."""
    test_real_peers.test_after_shutdown_nothing_listens_and_nothing_is_left(door)
