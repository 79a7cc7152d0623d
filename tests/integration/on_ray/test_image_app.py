"""Your own deployment: deployments/image_app.py deployed from deployments/image_app.yaml, over HTTP.

Real Ray, real Triton. The config file is deployed the way ``serve run`` does it
(``ServeDeploySchema`` to the Serve controller, which imports
``deployments.image_app:app`` itself), plus a copy of the app with
``transport: grpc`` (tritonclient.grpc to the same Triton). Expected answers are
computed here with numpy from the pixels the test encoded, not by the app's code.
"""

from __future__ import annotations

import io
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import yaml

from tests.helpers import free_port

from .conftest import REPO, deploy_config, local_ray

pytest.importorskip("PIL")

pytestmark = pytest.mark.slow

APP_FILE = REPO / "deployments" / "image_app.yaml"
MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{pid}_")]


@pytest.fixture(scope="module")
def image_app():
    """(handle of the shm app, URL of the shm app, URL of the grpc app, the node actor's pid)."""
    from ray import serve

    if str(REPO) not in sys.path:  # `serve run` from the repository root has it as its app dir
        sys.path.insert(0, str(REPO))
    spec = yaml.safe_load(APP_FILE.read_text())
    port = free_port()
    spec["http_options"]["port"] = port
    shm = spec["applications"][0]
    shm["args"]["quarantine_s"] = 1.0
    grpc = yaml.safe_load(yaml.safe_dump(shm))
    grpc.update(name="images-grpc", route_prefix="/embed-grpc")
    grpc["args"]["transport"] = "grpc"
    spec["applications"].append(grpc)
    actor_pid = None
    with local_ray():
        deploy_config(spec, 300)
        handle = serve.get_deployment_handle("ImageEmbedder", app_name="images")
        actor_pid = handle.node.remote().result()["actor_pid"]
        base = f"http://127.0.0.1:{port}"
        yield handle, base + "/embed", base + "/embed-grpc", actor_pid
    deadline = time.monotonic() + 60
    while actor_pid is not None and _segments(actor_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert actor_pid is None or _segments(actor_pid) == [], "segments left in /dev/shm"


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _expected(pixels: np.ndarray) -> dict:
    """What multi_io answers for a 224x224 image, computed independently of the app."""
    image = ((pixels / 255.0 - MEAN) / STD).transpose(2, 0, 1)
    embedding = image.reshape(512, 294).sum(axis=-1)
    counts, _ = np.histogram(pixels, bins=10, range=(0, 256))
    return {
        "top5": list(np.argsort(-embedding)[:5]),
        "scores": embedding,
        "norm": float(np.linalg.norm(embedding)),
        "histogram": list(counts.reshape(5, 2).sum(axis=1)),
    }


@pytest.fixture(scope="module")
def known():
    pixels = np.random.default_rng(18).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return pixels, _encode(pixels, "PNG")


def _check(answer: dict, pixels: np.ndarray) -> None:
    want = _expected(pixels)
    assert answer["model"] == "multi_io"
    assert (answer["format"], answer["width"], answer["height"]) == ("PNG", 224, 224)
    assert [entry["index"] for entry in answer["top5"]] == want["top5"]
    for entry in answer["top5"]:
        assert entry["score"] == pytest.approx(want["scores"][entry["index"]], rel=1e-4, abs=1e-3)
    assert answer["norm"] == pytest.approx(want["norm"], rel=1e-5)
    assert answer["histogram"] == want["histogram"]


def test_known_png(image_app, known):
    _, url, _, _ = image_app
    pixels, data = known
    response = requests.post(url, data=data, headers={"content-type": "image/png"}, timeout=60)
    assert response.status_code == 200, response.text
    _check(response.json(), pixels)


def test_grpc_transport_gives_the_same_answer(image_app, known):
    _, url, grpc_url, _ = image_app
    pixels, data = known
    answers = [requests.post(u, data=data, timeout=60) for u in (url, grpc_url)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    _check(answers[1].json(), pixels)
    assert answers[0].json() == answers[1].json()


def test_jpeg_of_another_size_is_resized(image_app):
    _, url, _, _ = image_app
    pixels = np.random.default_rng(5).integers(0, 256, (200, 320, 3), dtype=np.uint8)
    response = requests.post(url, data=_encode(pixels, "JPEG"), timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["format"], answer["width"], answer["height"]) == ("JPEG", 320, 200)
    assert sum(answer["histogram"]) == 224 * 224 * 3
    assert len(answer["top5"]) == 5


@pytest.mark.parametrize(
    "body, words",
    [
        (b"", "empty request body"),
        (b"certainly not an image", "not a PNG or JPEG"),
        (b"GIF89a" + bytes(64), "not a PNG or JPEG"),
    ],
)
def test_bad_body_is_a_400_with_a_message(image_app, body, words):
    _, url, _, _ = image_app
    response = requests.post(url, data=body, timeout=60)
    assert response.status_code == 400
    assert words in response.json()["error"]


def test_truncated_png_is_a_400(image_app, known):
    _, url, _, _ = image_app
    response = requests.post(url, data=known[1][: len(known[1]) // 2], timeout=60)
    assert response.status_code == 400
    assert "cannot decode the image" in response.json()["error"]


def test_get_is_refused(image_app):
    _, url, _, _ = image_app
    response = requests.get(url, timeout=60)
    assert response.status_code == 405
    assert "POST" in response.json()["error"]


def test_concurrent_requests_return_every_slot(image_app, known):
    handle, url, _, actor_pid = image_app
    pixels, data = known
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: requests.post(url, data=data, timeout=120), range(32)))
    assert [a.status_code for a in answers] == [200] * 32
    for answer in answers:
        _check(answer.json(), pixels)
    assert handle.busy_slots.remote().result() == {"multi_io": 0}
    assert _segments(actor_pid)  # the pools live in /dev/shm until the node actor stops (checked after)
