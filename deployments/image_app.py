"""Your own deployment on the node's Triton: an encoded image in over HTTP, JSON out.

``POST`` a PNG or JPEG as the request body. The replica decodes it (Pillow),
resizes it to 224x224, normalises it with the ImageNet mean and deviation
*straight into a leased shared-memory slot* of ``multi_io`` (the only array it
writes is the slot's own input view), runs the model on the node's Triton and
answers JSON::

    {"model": "multi_io", "format": "PNG", "width": 640, "height": 480,
     "top5": [{"index": 17, "score": 41.5}, ...], "norm": 812.3,
     "histogram": [ ... 5 counts of pixel values ... ]}

A body that is not an image answers 400 with ``{"error": "..."}``; one over
``MAX_BODY_BYTES`` answers 413. Deploy it from the repository root with::

    serve run deployments/image_app.yaml

The ``args`` are those of ``ray_triton_shm.serve:app`` (``model_repository``,
``pools``, node settings, ``slots_per_model``, ``memory``): given the same
ones, this app and the KServe app share one Triton per node. Two args are this
app's own: ``model`` (default ``multi_io``) and ``transport`` (``shm``, the
default, or ``grpc``: the same app calling Triton with ``tritonclient.grpc``,
for the benchmark's comparison).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from ray_triton_shm.errors import InputError, PoolTimeoutError, RayTritonShmError, UnavailableError
from ray_triton_shm.node import NodeClient

SIZE = 224
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_PIXELS = 50_000_000  # larger images are refused (a decompression bomb guard)
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
# (x / 255 - mean) / std == x * _SCALE - _OFFSET, per channel, shaped to broadcast over (3, H, W).
_SCALE = (1.0 / (255.0 * STD)).astype(np.float32)[:, None, None]
_OFFSET = (MEAN / STD).astype(np.float32)[:, None, None]
_APP_KEYS = ("model", "transport")


class ImageDecodeError(InputError):
    """The request body is not a PNG or JPEG image Pillow can decode."""


def decode(data: bytes) -> tuple[Any, str, int, int]:
    """The image in ``data`` as a 224x224 RGB Pillow image, its format and original size.

    Raises:
        ImageDecodeError: Empty data, not a PNG/JPEG, truncated or too large.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageDecodeError("empty request body: POST a PNG or JPEG image")
    try:
        image = Image.open(io.BytesIO(data), formats=("PNG", "JPEG"))
        fmt, (width, height) = image.format, image.size
        if width * height > MAX_PIXELS:
            raise ImageDecodeError(f"image of {width}x{height} pixels is too large (at most {MAX_PIXELS})")
        image = image.convert("RGB")
        if image.size != (SIZE, SIZE):
            image = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    except UnidentifiedImageError as e:
        raise ImageDecodeError("request body is not a PNG or JPEG image") from e
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageDecodeError(f"cannot decode the image: {e}") from e
    return image, fmt, width, height


def normalise_into(image: Any, out: np.ndarray) -> np.ndarray:
    """Write ``image`` (224x224 RGB) normalised, channels first, into ``out`` (float32, (3, 224, 224)).

    Returns a 10-bin histogram of its pixel values (the model's second input).
    """
    pixels = np.asarray(image)  # (H, W, 3) uint8: the decoder's own pixels
    np.multiply(pixels.transpose(2, 0, 1), _SCALE, out=out, casting="unsafe")
    np.subtract(out, _OFFSET, out=out)
    counts, _ = np.histogram(pixels, bins=10, range=(0, 256))
    return counts


def summarise(embedding: np.ndarray, histogram: np.ndarray) -> dict[str, Any]:
    """The JSON answer's model part from ``OUTPUT0`` (512 floats) and ``OUTPUT1`` (5 ints)."""
    order = np.argsort(-embedding, kind="stable")[:5]
    return {
        "top5": [{"index": int(i), "score": float(embedding[i])} for i in order],
        "norm": float(np.linalg.norm(embedding)),
        "histogram": [int(v) for v in histogram],
    }


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=16)
class ImageEmbedder:
    """Decode, normalise into a leased slot, run the model, answer JSON.

    Args:
        args: The Serve app's args (see ``ray_triton_shm.serve.app``).
        model: The model to run (inputs like ``multi_io``'s).
        transport: ``shm`` (slots of the node's pools) or ``grpc``
            (``tritonclient.grpc`` to the node's Triton, tensors serialised).
    """

    def __init__(self, args: Mapping[str, Any], model: str = "multi_io", transport: str = "shm") -> None:
        if transport not in ("shm", "grpc"):
            raise InputError(f"transport must be shm or grpc, got {transport!r}")
        self._client = NodeClient.from_args(args, kind="serve")
        self._model = model
        self._transport = transport
        self._grpc = None
        if transport == "grpc":
            import tritonclient.grpc as grpcclient

            self._grpc = grpcclient.InferenceServerClient(self._client.info.grpc_url)

    def _infer_shm(self, image: Any) -> dict[str, Any]:
        with self._client.lease(self._model) as lease:
            tensor = lease.input("INPUT0", (1, 3, SIZE, SIZE))
            counts = normalise_into(image, tensor[0])
            lease.input("INPUT1", (1, 10))[0] = counts
            outputs = self._client.run(lease)
            answer = summarise(outputs["OUTPUT0"][0], outputs["OUTPUT1"][0])
            del outputs, tensor  # no view outlives the lease: the slot goes straight back
        return answer

    def _infer_grpc(self, image: Any) -> dict[str, Any]:
        import tritonclient.grpc as grpcclient

        tensor = np.empty((1, 3, SIZE, SIZE), np.float32)
        counts = normalise_into(image, tensor[0])
        inputs = [
            grpcclient.InferInput("INPUT0", [1, 3, SIZE, SIZE], "FP32"),
            grpcclient.InferInput("INPUT1", [1, 10], "INT32"),
        ]
        inputs[0].set_data_from_numpy(tensor)
        inputs[1].set_data_from_numpy(counts.astype(np.int32)[None])
        timeout = self._client.client.config.request_timeout_s
        result = self._grpc.infer(self._model, inputs, client_timeout=timeout)
        return summarise(result.as_numpy("OUTPUT0")[0], result.as_numpy("OUTPUT1")[0])

    def _handle(self, body: bytes) -> dict[str, Any]:
        image, fmt, width, height = decode(body)
        infer = self._infer_shm if self._transport == "shm" else self._infer_grpc
        return {"model": self._model, "format": fmt, "width": width, "height": height, **infer(image)}

    async def __call__(self, request: Request) -> JSONResponse:
        if request.method != "POST":
            return JSONResponse({"error": "POST a PNG or JPEG image as the request body"}, status_code=405)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return JSONResponse({"error": f"body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        try:
            return JSONResponse(await asyncio.to_thread(self._handle, body))
        except InputError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except (PoolTimeoutError, UnavailableError) as e:
            return JSONResponse({"error": f"busy or unavailable: {e}"}, status_code=503)
        except RayTritonShmError as e:
            return JSONResponse({"error": f"inference failed: {type(e).__name__}"}, status_code=500)

    async def busy_slots(self) -> dict[str, int]:
        """Slots of each model this replica holds right now (0 when idle)."""
        return {stats.model: stats.busy for stats in self._client.client.pool_stats()}

    async def node(self) -> dict[str, Any]:
        """The node actor and Triton this replica uses."""
        info = self._client.info
        return {"actor_pid": info.actor_pid, "triton_pid": info.triton_pid, "grpc_url": info.grpc_url}


def app(args: Mapping[str, Any]) -> serve.Application:
    """Application builder (``import_path: deployments.image_app:app``).

    Args:
        args: ``ray_triton_shm.serve:app``'s args, plus ``model`` and ``transport``.

    Invalid node args fail in the replica's constructor (``NodeClient.from_args``).
    """
    node_args = {k: v for k, v in dict(args or {}).items() if k not in _APP_KEYS}
    return ImageEmbedder.bind(
        node_args, str(args.get("model", "multi_io")), str(args.get("transport", "shm"))
    )
