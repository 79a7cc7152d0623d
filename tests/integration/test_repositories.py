"""Model repositories Triton reads itself: a real local S3 endpoint (moto's standalone server).

The embedded Triton is built with S3 support; a local endpoint is written
``s3://http://127.0.0.1:PORT/bucket/path``. The test serves two repositories at
once: ``add_sub`` from S3 and ``strings`` from a local directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ray_triton_shm import ServerConfig, ServerStartError, TritonServer, TritonShmClient
from tests.helpers import free_port

from .conftest import MODEL_REPOSITORY

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's standalone S3 server on loopback, stopped (and checked) after the test."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)  # for boto3 here and for Triton, which inherits them
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.poll() is not None


def _upload(endpoint: str, bucket: str, prefix: str, model_dir: Path) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=bucket)
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            key = f"{prefix}/{model_dir.name}/{path.relative_to(model_dir).as_posix()}"
            s3.upload_file(str(path), bucket, key)


def test_s3_and_local_repositories_at_once(s3_endpoint: str, tmp_path: Path) -> None:
    _upload(s3_endpoint, "models", "repo", MODEL_REPOSITORY / "add_sub")
    local = tmp_path / "local"
    shutil.copytree(MODEL_REPOSITORY / "strings", local / "strings")
    s3_uri = f"s3://{s3_endpoint}/models/repo"
    config = ServerConfig(model_repository=(s3_uri, str(local)))
    assert config.model_repository == (s3_uri, str(local))  # passed through unchanged
    assert f"--model-repository={s3_uri}" in config.server_flags()
    with TritonServer(config) as server, TritonShmClient(url=server.grpc_url) as client:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        result = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        assert result.path == "shm"  # a model read from S3 gets slots like any other
        np.testing.assert_array_equal(result["OUTPUT0"], a + a)
        np.testing.assert_array_equal(result["OUTPUT1"], a - a)
        text = client.infer("strings", {"TEXT": np.array([["s3"]], dtype=object)})
        assert text.path == "grpc" and text["UPPER"].tolist() == [[b"S3"]]
        index = client._grpc.get_model_repository_index(as_json=True)["models"]
        assert {m["name"] for m in index} == {"add_sub", "strings"}


def test_missing_s3_bucket_fails_the_start_with_triton_s_reason(s3_endpoint: str) -> None:
    config = ServerConfig(model_repository=f"s3://{s3_endpoint}/no-such-bucket/repo", startup_timeout_s=60)
    server = TritonServer(config)
    with pytest.raises(ServerStartError) as info:
        server.start()
    print(info.value)  # quoted in the closing note
    assert "S3" in str(info.value) and "no-such-bucket" in str(info.value)
    server.stop()
    assert not server.is_alive()
