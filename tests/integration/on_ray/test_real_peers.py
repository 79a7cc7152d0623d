"""Real HTTP/2 and HTTP/1.1 peers against the front door, every answer checked.

deployments/triton_shm.yaml (one replica, its front door on free ports), a
local Ray and the node's real Triton. The peers run unchanged: tritonclient's
HTTP and gRPC clients (sync, ``async_infer`` and the aio clients), grpcio's
generated stubs with large calls at once on one channel, ``h2load`` with many
large calls on one connection, ``nghttp`` and ``curl`` (HTTP/2 with prior
knowledge and HTTP/1.1). Each answer's outputs are compared with its inputs
(``identity`` returns them) and, where a byte-for-byte answer is defined, with
the node's Triton's own answer to the same request. A strict client written
frame by frame (:class:`~tests.integration.on_ray.real_peers.RawH2`) checks the
server's flow control byte by byte and its answers to window updates that
break RFC 9113 (section 6.9). The programs come from the Makefile's
``peers`` target; a test whose program is absent skips, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from ray_triton_shm._private.bench.attacks.wire import grpc_framed
from ray_triton_shm._private.bench.attacks.wire import identity_message as identity_request

from .real_peers import (
    DATA,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    GRPC_HEADERS,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_WINDOW,
    MODEL_INFER,
    PROTOCOL_ERROR,
    RST_STREAM,
    SERVER_LIVE,
    RawH2,
    connections_to,
    curl_answer,
    ended,
    grpc_unframed,
    h2load_summary,
    identity_output,
    nghttp_streams,
    no_slot_held,
    random_rows,
    reset_code,
    run_peer,
    serve_door,
    shown,
    stream_frames,
    tool,
    unary_answer,
)

MB = 262144  # FP32 elements in 1 MiB


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """The app's front door and its node's Triton (see :func:`serve_door`)."""
    with serve_door(tmp_path_factory.mktemp("peers")) as where:
        yield where


# -- tritonclient ---------------------------------------------------------------------------------


def _http_input(module, x: np.ndarray, binary: bool = True):
    tensor = module.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def _grpc_input(module, x: np.ndarray):
    tensor = module.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def test_tritonclient_http_sync_async_and_aio_clients_get_their_inputs_back(door) -> None:
    rows = random_rows([16, MB, 3 * MB, 64, 2 * MB, 5, MB // 2, 4 * MB], seed=1)
    client = httpclient.InferenceServerClient(door["http"], concurrency=4, network_timeout=120)
    try:
        for binary in (True, False):
            x = rows[0]
            wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
            result = client.infer("identity", [_http_input(httpclient, x, binary)], outputs=wanted)
            assert np.array_equal(result.as_numpy("OUTPUT0"), x)
        pending = [client.async_infer("identity", [_http_input(httpclient, x)]) for x in rows]
        for x, request in zip(rows, pending, strict=True):
            assert np.array_equal(request.get_result(timeout=120).as_numpy("OUTPUT0"), x)
    finally:
        client.close()

    async def concurrently() -> list[np.ndarray]:
        aio = httpaio.InferenceServerClient(door["http"], conn_limit=8)
        try:
            assert await aio.is_server_live() and await aio.is_model_ready("identity")
            answers = await asyncio.gather(
                *(aio.infer("identity", [_http_input(httpaio, x)], timeout=120) for x in rows)
            )
            return [answer.as_numpy("OUTPUT0") for answer in answers]
        finally:
            await aio.close()

    for x, y in zip(rows, asyncio.run(concurrently()), strict=True):
        assert np.array_equal(y, x)


def test_tritonclient_grpc_sync_async_and_aio_clients_get_their_inputs_back(door) -> None:
    rows = random_rows([16, MB, 3 * MB, 64, 2 * MB, 5, MB // 2, 4 * MB], seed=2)
    client = grpcclient.InferenceServerClient(door["grpc"])
    triton = grpcclient.InferenceServerClient(door["triton"][1])
    try:
        x = rows[1]
        ours = client.infer("identity", [_grpc_input(grpcclient, x)], request_id="r1")
        theirs = triton.infer("identity", [_grpc_input(grpcclient, x)], request_id="r1")
        assert ours.get_response() == theirs.get_response()
        assert np.array_equal(ours.as_numpy("OUTPUT0"), x)
        done: dict[int, tuple] = {}
        for i, x in enumerate(rows):
            client.async_infer(
                "identity",
                [_grpc_input(grpcclient, x)],
                lambda result, error, i=i: done.__setitem__(i, (result, error)),
            )
        deadline = time.monotonic() + 120
        while len(done) < len(rows) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(done) == list(range(len(rows))), f"answered: {sorted(done)}"
        for i, x in enumerate(rows):
            result, error = done[i]
            assert error is None, error
            assert np.array_equal(result.as_numpy("OUTPUT0"), x)
    finally:
        client.close()
        triton.close()

    async def concurrently() -> list[np.ndarray]:
        aio = grpcaio.InferenceServerClient(door["grpc"])
        try:
            assert await aio.is_server_live() and await aio.is_model_ready("identity")
            answers = await asyncio.gather(
                *(aio.infer("identity", [_grpc_input(grpcaio, x)], client_timeout=120) for x in rows)
            )
            return [answer.as_numpy("OUTPUT0") for answer in answers]
        finally:
            await aio.close()

    for x, y in zip(rows, asyncio.run(concurrently()), strict=True):
        assert np.array_equal(y, x)


def test_tritonclient_classification_is_refused_not_answered_with_the_whole_tensor(door) -> None:
    """``class_count`` asks for the top classes (Triton answers them as BYTES); the front door
    does not serve the classification extension, and says so rather than answer the tensor."""
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    for module, url, status in (
        (httpclient, door["http"], "501"),
        (grpcclient, door["grpc"], "StatusCode.UNIMPLEMENTED"),
    ):
        tensor = module.InferInput("INPUT0", [1, 8], "FP32")
        tensor.set_data_from_numpy(x)
        wanted = [module.InferRequestedOutput("OUTPUT0", class_count=3)]
        triton = module.InferenceServerClient(door["triton"][0 if module is httpclient else 1])
        client = module.InferenceServerClient(url)
        try:
            top = triton.infer("identity", [tensor], outputs=wanted).as_numpy("OUTPUT0")
            assert top.tolist() == [[b"7.000000:7", b"6.000000:6", b"5.000000:5"]]
            with pytest.raises(InferenceServerException) as refused:
                client.infer("identity", [tensor], outputs=wanted)
            assert refused.value.status() == status and "classification" in refused.value.message()
            assert np.array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
        finally:
            client.close()
            triton.close()


# -- grpcio ---------------------------------------------------------------------------------------


def test_grpcio_large_calls_at_once_on_one_channel_each_get_their_answer(door) -> None:
    """8 calls of 4 to 16 MB at once on one channel (one HTTP/2 connection); the answer of the
    first is byte for byte the node's Triton's."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    rows = random_rows([4 * MB, 16 * MB, 6 * MB, 12 * MB, 8 * MB, 16 * MB, 5 * MB, 10 * MB], seed=3)
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    requests = [pb.ModelInferRequest.FromString(identity_request(x, f"call-{i}")) for i, x in enumerate(rows)]
    port = int(door["grpc"].rsplit(":", 1)[1])
    with grpc.insecure_channel(door["grpc"], options=unlimited) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=60).live
        futures = [stub.ModelInfer.future(request, timeout=180) for request in requests]
        answers = [future.result() for future in futures]
        assert connections_to(port) == 1, "grpcio opened more than one connection"
    for i, (x, answer) in enumerate(zip(rows, answers, strict=True)):
        assert answer.id == f"call-{i}"
        assert np.array_equal(identity_output(answer.SerializeToString()), x), f"call {i}"
    with grpc.insecure_channel(door["triton"][1], options=unlimited) as channel:
        theirs = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(requests[0], timeout=120)
    assert answers[0].SerializeToString() == theirs.SerializeToString()


def test_the_door_takes_its_bound_from_the_deployments_max_ongoing_requests(door) -> None:
    """The shipped deployment's ``max_ongoing_requests`` (32) is the bound of its front door's calls:
    read from Serve's replica context, where Serve keeps it in a private field."""
    from ray import serve

    stats = serve.get_app_handle("triton").frontdoor_stats.remote().result(timeout_s=60)
    assert stats["max_ongoing"] == 32, stats
    assert stats["grpc_port"] == int(door["grpc"].rsplit(":", 1)[1]), stats


# -- h2load ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "clients,windows",
    [(1, []), (4, []), (1, ["-w", "16", "-W", "16"])],  # the last: 64 KiB windows, answers of 4 MB
    ids=["one-connection", "four-connections", "one-connection-small-windows"],
)
def test_h2load_many_large_calls_at_once_all_succeed(door, tmp_path: Path, clients: int, windows) -> None:
    """32 ModelInfer calls of 4 MB, 8 at once on each connection; every one answers 200 with
    ``grpc-status`` in trailers and exactly the bytes of the node's Triton's answer."""
    h2load = tool("h2load")
    message = identity_request(random_rows([4 * MB], seed=4)[0])
    (tmp_path / "infer.bin").write_bytes(grpc_framed(message))
    answer = grpc_framed(unary_answer(door["triton"][1], message))
    n, url = 32, f"http://{door['grpc']}{MODEL_INFER}"
    result = run_peer(
        [h2load, *f"-n {n} -c {clients} -m 8".split(), *windows, "-d", "infer.bin", *GRPC_HEADERS, url],
        tmp_path,
    )
    assert result.returncode == 0, shown(result)
    summary = h2load_summary(result.stdout.decode())
    assert (summary.total, summary.started, summary.done, summary.succeeded) == (n, n, n, n), summary
    assert (summary.failed, summary.errored, summary.timeout) == (0, 0, 0), summary
    assert summary.status == {"2xx": n, "3xx": 0, "4xx": 0, "5xx": 0}, summary
    # Every answer whole: an error (grpc-status in trailers, no message) would carry no data.
    assert summary.data_bytes == n * len(answer), (summary.data_bytes, n * len(answer))
    assert no_slot_held()


# -- nghttp and curl over HTTP/2 ------------------------------------------------------------------


def test_nghttp_model_infer_and_server_live(door, tmp_path: Path) -> None:
    """Four ModelInfer calls at once on one connection (nghttp's 64 KiB windows, 1 MB answers; padded
    frames, a header block in CONTINUATION frames), then ServerLive; each answer's trailers say
    ``grpc-status: 0`` and its message is the node's Triton's."""
    nghttp = tool("nghttp")
    from tritonclient.grpc import service_pb2 as pb

    x = random_rows([MB], seed=5)[0]
    message = identity_request(x, "nghttp")
    (tmp_path / "infer.bin").write_bytes(grpc_framed(message))
    (tmp_path / "live.bin").write_bytes(grpc_framed(b""))
    infer, live = (f"http://{door['grpc']}{path}" for path in (MODEL_INFER, SERVER_LIVE))
    result = run_peer(  # its frames padded (-b), its header blocks cut into CONTINUATION frames
        [nghttp, *"-v -t 60 -m 4 -b 200 --continuation -d infer.bin".split(), *GRPC_HEADERS, infer], tmp_path
    )
    assert result.returncode == 0, shown(result)
    streams = nghttp_streams(result.stdout)
    assert len(streams) == 4, shown(result)
    theirs = unary_answer(door["triton"][1], message)
    for stream in streams.values():
        assert stream.headers[":status"] == "200" and stream.headers["content-type"] == "application/grpc"
        assert stream.trailers.get("grpc-status") == "0", stream.trailers
        answer = grpc_unframed(bytes(stream.body))
        assert np.array_equal(identity_output(answer), x)
        assert answer == theirs
    result = run_peer([nghttp, *"-v -t 60 -d live.bin".split(), *GRPC_HEADERS, live], tmp_path)
    assert result.returncode == 0, shown(result)
    (stream,) = nghttp_streams(result.stdout).values()
    assert stream.headers[":status"] == "200" and stream.trailers.get("grpc-status") == "0", stream
    assert pb.ServerLiveResponse.FromString(grpc_unframed(bytes(stream.body))).live


def _curl_grpc(curl: str, address: str, path: str, body: Path, out: Path) -> tuple[dict, dict, bytes]:
    dump = out.with_suffix(".head")
    flags = "-sS --http2-prior-knowledge --max-time 60 --data-binary".split()
    url = f"http://{address}{path}"
    argv = [curl, *flags, f"@{body.name}", *GRPC_HEADERS, "-D", dump.name, "-o", out.name, url]
    result = run_peer(argv, body.parent)
    assert result.returncode == 0, shown(result)
    statuses, headers, trailers = curl_answer(dump.read_bytes().decode())
    assert statuses == ["HTTP/2 200"], statuses
    return headers, trailers, out.read_bytes()


def test_curl_http2_prior_knowledge_model_infer_and_server_live(door, tmp_path: Path) -> None:
    curl = tool("curl")
    from tritonclient.grpc import service_pb2 as pb

    x = random_rows([2 * MB], seed=6)[0]
    (tmp_path / "infer.bin").write_bytes(grpc_framed(identity_request(x, "curl")))
    (tmp_path / "live.bin").write_bytes(grpc_framed(b""))
    answers = []
    for address in (door["grpc"], door["triton"][1]):
        headers, trailers, body = _curl_grpc(
            curl, address, MODEL_INFER, tmp_path / "infer.bin", tmp_path / "out"
        )
        assert headers["content-type"] == "application/grpc" and trailers.get("grpc-status") == "0", trailers
        answers.append(grpc_unframed(body))
    assert np.array_equal(identity_output(answers[0]), x)
    assert answers[0] == answers[1], "not the node's Triton's answer"
    headers, trailers, body = _curl_grpc(
        curl, door["grpc"], SERVER_LIVE, tmp_path / "live.bin", tmp_path / "live"
    )
    assert trailers.get("grpc-status") == "0", trailers
    assert pb.ServerLiveResponse.FromString(grpc_unframed(body)).live


# -- curl over HTTP/1.1 ---------------------------------------------------------------------------


def test_curl_http1_kserve_json_and_binary_tensors_on_one_kept_alive_connection(door, tmp_path: Path) -> None:
    """A JSON request, then one with binary tensors, in one curl run (the connection re-used);
    the JSON answer is the node's Triton's, the binary one returns the input's bytes."""
    curl = tool("curl")
    x = random_rows([64], seed=7)[0]
    request = {
        "id": "j1",
        "inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": x.ravel().tolist()}],
    }
    (tmp_path / "json.bin").write_text(json.dumps(request))
    y = random_rows([MB], seed=8)[0]
    header = json.dumps(
        {
            "id": "b1",
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, MB],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": y.nbytes},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    (tmp_path / "binary.bin").write_bytes(header + y.tobytes())

    def run(address: str) -> tuple[dict, dict, bytes, bytes, str]:
        url = f"http://{address}/v2/models/identity/infer"
        as_json = [
            "-H",
            "Content-Type: application/json",
            *"--data-binary @json.bin -D a.head -o a.out".split(),
        ]
        binary = ["-H", "Content-Type: application/octet-stream"]
        binary += ["-H", f"Inference-Header-Content-Length: {len(header)}"]
        binary += "--data-binary @binary.bin -D b.head -o b.out".split()
        http1 = "--http1.1 --max-time 60".split()
        result = run_peer(
            [curl, "-sS", "-v", *http1, *as_json, url, "--next", *http1, *binary, url], tmp_path
        )
        assert result.returncode == 0, shown(result)
        heads = [curl_answer((tmp_path / f"{part}.head").read_bytes().decode()) for part in "ab"]
        for statuses, _, _ in heads:  # curl sends a body over 1 MiB after a 100 Continue
            assert statuses[-1] == "HTTP/1.1 200 OK" and set(statuses[:-1]) <= {"HTTP/1.1 100 Continue"}, (
                heads
            )
        stderr = result.stderr.decode(errors="replace")
        a, b = (tmp_path / "a.out").read_bytes(), (tmp_path / "b.out").read_bytes()
        return heads[0][1], heads[1][1], a, b, stderr

    _, binary_head, json_body, binary_body, log = run(door["http"])
    assert "Re-using existing connection" in log, log[-2000:]
    answer = json.loads(json_body)
    assert answer == json.loads(run(door["triton"][0])[2])
    (output,) = answer["outputs"]
    assert output["shape"] == [1, 64] and np.array_equal(np.array(output["data"], np.float32), x.ravel())
    length = int(binary_head["inference-header-content-length"])
    meta = json.loads(binary_body[:length])
    assert meta["id"] == "b1" and meta["outputs"][0]["parameters"]["binary_data_size"] == y.nbytes, meta
    assert np.array_equal(np.frombuffer(binary_body[length:], np.float32).reshape(1, MB), y)


def test_h2load_pipelined_http1_calls_all_succeed(door, tmp_path: Path) -> None:
    """h2load over HTTP/1.1, 10 requests pipelined on each of 2 connections: all 200, each answer
    as long as the (checked) answer to the same request."""
    h2load = tool("h2load")
    x = random_rows([256], seed=12)[0]
    request = {
        "inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    (tmp_path / "json.bin").write_text(json.dumps(request))
    url = f"http://{door['http']}/v2/models/identity/infer"
    answer = requests.post(url, data=(tmp_path / "json.bin").read_bytes(), timeout=60)
    assert answer.status_code == 200
    assert np.array_equal(np.array(answer.json()["outputs"][0]["data"], np.float32), x.ravel())
    n = 200
    result = run_peer(
        [h2load, *f"--h1 -n {n} -c 2 -m 10 -d json.bin -H".split(), "content-type: application/json", url],
        tmp_path,
    )
    assert result.returncode == 0, shown(result)
    summary = h2load_summary(result.stdout.decode())
    assert (summary.succeeded, summary.failed, summary.errored, summary.timeout) == (n, 0, 0, 0), summary
    assert summary.status["2xx"] == n and summary.data_bytes == n * len(answer.content), summary


def test_curl_head_requests_get_no_content(door) -> None:
    """HEAD (refused with 405, as by Triton) then GET on one connection: the answer to HEAD carries
    no content (RFC 9110 9.3.2) that curl would have to drop, and the GET is answered."""
    curl = tool("curl")
    url = f"http://{door['http']}/v2/health/live"
    then_get = "--next --max-time 30 -o /dev/null -w %{http_code}".split()
    result = run_peer([curl, *"-sS -v --http1.1 --max-time 30 -I".split(), url, *then_get, url])
    log = result.stderr.decode(errors="replace")
    assert result.returncode == 0 and "Re-using existing connection" in log, shown(result)
    assert "< HTTP/1.1 405 " in log and result.stdout.decode().endswith("200"), shown(result)
    assert "Excess found" not in log, log[-2000:]


def test_curl_with_the_front_door_as_its_proxy_is_answered_for_the_path_it_names(
    door, tmp_path: Path
) -> None:
    """curl sends an absolute-form target to a proxy (``POST http://host/path``); a server accepts
    it (RFC 9112 3.2.2) and answers for its path, as Triton does."""
    curl = tool("curl")
    x = random_rows([32], seed=13)[0]
    request = {
        "inputs": [{"name": "INPUT0", "shape": [1, 32], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    (tmp_path / "json.bin").write_text(json.dumps(request))
    answers = []
    for proxy in (door["http"], door["triton"][0]):
        flags = ["-sS", "--max-time", "30", "--proxy", f"http://{proxy}", "--data-binary", "@json.bin"]
        result = run_peer(
            [curl, *flags, "-w", "\n%{http_code}", "http://example.invalid/v2/models/identity/infer"],
            tmp_path,
        )
        assert result.returncode == 0, shown(result)
        body, _, code = result.stdout.decode().rpartition("\n")
        assert code == "200", shown(result)
        answers.append(json.loads(body))
    assert answers[0] == answers[1]
    assert np.array_equal(np.array(answers[0]["outputs"][0]["data"], np.float32), x.ravel())


# -- flow control, frame by frame -----------------------------------------------------------------


def test_answers_keep_exactly_within_the_clients_windows(door) -> None:
    """Three 1 MB answers at once to a client with a 4096-byte initial stream window and the default
    65535-byte connection window, which it opens only when one is exhausted, by increments of 1
    byte to 64 KiB: no DATA frame is ever larger than a window (or 16384 bytes), every answer
    arrives whole and right."""
    increments = [1, 4096, 40000, 7, 16384, 65535, 1000, 3]
    rows = dict(zip((1, 3, 5), random_rows([MB, MB, MB], seed=9), strict=True))
    granted = {"n": 0}
    with RawH2(door["grpc"], initial_window=4096) as h2:
        windows = {0: 65535, **{s: 4096 for s in rows}}
        for stream, x in rows.items():
            h2.request(stream, MODEL_INFER, grpc_framed(identity_request(x)))

        def on_data(stream: int, payload: bytes) -> None:
            size = len(payload)
            assert size <= 16384, f"a DATA frame of {size} bytes"
            assert size <= windows[stream] and size <= windows[0], (size, windows)
            windows[stream] -= size
            windows[0] -= size
            for key in [0, stream]:
                if windows[key] == 0:
                    increment = increments[granted["n"] % len(increments)]
                    granted["n"] += 1
                    windows[key] += increment
                    h2.window_update(key, increment)

        frames = h2.until(lambda frames: ended(frames, rows), on_data)
    blocks = [(s, h2.decode(p)) for k, _, s, p in frames if k == HEADERS]
    for stream, x in rows.items():
        head, trailers = [fields for s, fields in blocks if s == stream]
        assert head[":status"] == "200" and trailers["grpc-status"] == "0", (head, trailers)
        body = b"".join(payload for _, payload in stream_frames(frames, stream, DATA))
        assert np.array_equal(identity_output(grpc_unframed(body)), x), stream
    assert granted["n"] > 50  # the answers were held to the windows many times over
    assert not any(k in (RST_STREAM, GOAWAY) for k, _, _, _ in frames)
    assert no_slot_held()


def test_stream_window_updates_of_zero_or_past_the_maximum_reset_only_that_stream(door) -> None:
    """RFC 9113 6.9: a zero increment on a stream is a stream error PROTOCOL_ERROR, a stream window
    past 2^31-1 one of FLOW_CONTROL_ERROR (a window of exactly 2^31-1 is fine); the connection and
    its other calls go on, the reset calls' slots come back, and their late DATA is ignored."""
    x = random_rows([MB], seed=10)[0]
    framed = grpc_framed(identity_request(x))
    half = len(framed) // 2
    with RawH2(door["grpc"]) as h2:
        h2.request(1, MODEL_INFER, framed[:half], end=False)  # a call still arriving (into a slot)
        h2.window_update(1, MAX_WINDOW - 65535)  # the stream's window: exactly 2^31-1
        assert reset_code(h2.confirmed_quiet(), 1) is None
        h2.window_update(1, 1)
        h2.request(3, MODEL_INFER, framed[:half], end=False)
        h2.window_update(3, 0)
        frames = h2.until(lambda f: reset_code(f, 1) is not None and reset_code(f, 3) is not None)
        assert (reset_code(frames, 1), reset_code(frames, 3)) == (FLOW_CONTROL_ERROR, PROTOCOL_ERROR)
        h2.data(1, framed[half:])  # after the reset: ignored
        h2.request(5, MODEL_INFER, framed)
        h2.request(7, SERVER_LIVE, grpc_framed(b""))
        frames = h2.until(lambda frames: ended(frames, (5, 7)))
        assert not any(k in (RST_STREAM, GOAWAY) for k, _, _, _ in frames)
        blocks = {s: h2.decode(p) for k, _, s, p in frames if k == HEADERS and p}
        body = b"".join(payload for _, payload in stream_frames(frames, 5, DATA))
    assert np.array_equal(identity_output(grpc_unframed(body)), x)
    assert no_slot_held()
    for stream in (5, 7):
        assert blocks[stream]["grpc-status"] == "0", blocks[stream]


def test_connection_window_updates_of_zero_or_past_the_maximum_end_the_connection(door) -> None:
    """On the connection, both are connection errors: GOAWAY with PROTOCOL_ERROR (a zero
    increment) or FLOW_CONTROL_ERROR (a window past 2^31-1, not one of exactly 2^31-1), naming
    the last stream the server took, then the connection closes."""
    with RawH2(door["grpc"]) as h2:
        h2.request(1, SERVER_LIVE, grpc_framed(b""))
        frames = h2.until(lambda frames: ended(frames, (1,)))  # its answer's bytes given back as they came
        assert [h2.decode(p) for _, p in stream_frames(frames, 1, HEADERS)][-1] == {"grpc-status": "0"}
        h2.window_update(0, MAX_WINDOW - 65535)  # the connection's window: exactly 2^31-1
        assert not any(k == GOAWAY for k, _, _, _ in h2.confirmed_quiet())
        h2.window_update(0, 1)
        last, code, _ = h2.goaway()
    assert (last, code) == (1, FLOW_CONTROL_ERROR)
    with RawH2(door["grpc"]) as h2:
        h2.window_update(0, 0)
        last, code, _ = h2.goaway()
    assert (last, code) == (0, PROTOCOL_ERROR)


def test_an_initial_window_setting_past_the_maximum_ends_the_connection(door) -> None:
    """RFC 9113 6.5.2 and 6.9.2: SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1, or a change of it that
    takes an open stream's window past 2^31-1, is a connection error FLOW_CONTROL_ERROR."""
    framed = grpc_framed(identity_request(random_rows([1024], seed=11)[0]))
    with RawH2(door["grpc"]) as h2:
        h2.request(1, MODEL_INFER, framed[:100], end=False)
        h2.window_update(1, MAX_WINDOW - 65535)
        h2.settings(INITIAL_WINDOW_SIZE, 65535)  # no change
        assert not any(k in (GOAWAY, RST_STREAM) for k, _, _, _ in h2.confirmed_quiet())
        h2.settings(INITIAL_WINDOW_SIZE, 65536)  # the open stream's window: 2^31
        assert h2.goaway()[:2] == (1, FLOW_CONTROL_ERROR)
    with RawH2(door["grpc"]) as h2:
        h2.settings(INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)
        assert h2.goaway()[:2] == (0, FLOW_CONTROL_ERROR)
    assert no_slot_held()


# -- last ------------------------------------------------------------------------------------------


def test_after_shutdown_nothing_listens_and_nothing_is_left(door) -> None:
    """Last in this module: no peer program is left running, and once the app is shut down its
    listeners, replica and shared memory are gone."""
    from ray import serve

    from ray_triton_shm.node import shutdown_node_actors

    peers = [p for p in psutil.Process().children(recursive=True) if p.name() in ("h2load", "nghttp", "curl")]
    assert not peers, peers
    where = door["where"]
    ports = [int(door[k].rsplit(":", 1)[1]) for k in ("http", "grpc")]
    serve.shutdown()
    shutdown_node_actors()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and psutil.pid_exists(where["pid"]):
        time.sleep(0.5)
    assert not psutil.pid_exists(where["pid"]), "the replica outlived serve.shutdown()"
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    owners = {where["actor_pid"], where["triton_pid"], where["pid"]}
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"rtshm_{p}_") for p in owners)]
    assert not left, left
