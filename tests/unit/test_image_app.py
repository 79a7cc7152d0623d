"""deployments/image_app.py's decoding and normalisation, without Ray or Triton."""

from __future__ import annotations

import importlib
import io
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm.errors import InputError

PIL = pytest.importorskip("PIL")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def image_app():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("deployments.image_app")


def _png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def test_normalise_into_writes_the_slot_view(image_app):
    pixels = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    image, fmt, width, height = image_app.decode(_png(pixels))
    assert (fmt, width, height) == ("PNG", 224, 224)
    slot = np.full((1, 3, 224, 224), np.nan, np.float32)  # stands for the lease's input view
    counts = image_app.normalise_into(image, slot[0])
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    want = ((pixels / 255.0 - mean) / std).transpose(2, 0, 1)
    np.testing.assert_allclose(slot[0], want, rtol=1e-5, atol=1e-5)
    assert counts.sum() == pixels.size and len(counts) == 10


def test_other_sizes_are_resized(image_app):
    pixels = np.zeros((100, 300, 3), np.uint8)
    image, fmt, width, height = image_app.decode(_png(pixels, "JPEG"))
    assert (fmt, width, height, image.size) == ("JPEG", 300, 100, (224, 224))


@pytest.mark.parametrize(
    "data, words",
    [(b"", "empty request body"), (b"plain text", "not a PNG or JPEG"), (b"GIF89a" + bytes(40), "not a PNG")],
)
def test_bad_bodies_are_input_errors(image_app, data, words):
    with pytest.raises(InputError, match=words) as info:
        image_app.decode(data)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and str(again) == str(info.value)


def test_truncated_png(image_app):
    data = _png(np.ones((224, 224, 3), np.uint8))
    with pytest.raises(image_app.ImageDecodeError, match="cannot decode"):
        image_app.decode(data[: len(data) // 2])


def test_summarise(image_app):
    embedding = np.arange(512, dtype=np.float32)
    answer = image_app.summarise(embedding, np.array([1, 2, 3, 4, 5], np.int32))
    assert [e["index"] for e in answer["top5"]] == [511, 510, 509, 508, 507]
    assert answer["histogram"] == [1, 2, 3, 4, 5]
    assert answer["norm"] == pytest.approx(float(np.linalg.norm(embedding)))


def test_config_file_parses_and_builds(image_app):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    spec = yaml.safe_load((REPO / "deployments" / "image_app.yaml").read_text())
    ServeDeploySchema.model_validate(spec)
    (application,) = spec["applications"]
    assert application["import_path"] == "deployments.image_app:app"
    built = image_app.app(application["args"])
    assert type(built).__name__ == "Application"
    assert [d["name"] for d in application["deployments"]] == ["ImageEmbedder"]
