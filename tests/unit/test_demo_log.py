"""The demo's quiet logging: other libraries' INFO and warnings to a file, errors still on stderr."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from ray_triton_shm._private.cli.demo_log import capture_ray_loggers, quiet_logs


def test_quiet_logs_send_chatter_to_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ray_logger = logging.getLogger("ray.data")
    own = logging.StreamHandler()
    ray_logger.addHandler(own)  # Ray gives its loggers stderr handlers of their own
    root = logging.getLogger()
    before = list(root.handlers)
    with quiet_logs(tmp_path / "demo.log") as path:
        assert own not in ray_logger.handlers and ray_logger.propagate
        logging.getLogger("ray.data").info("Execution plan: ReadItems->MapBatches")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecation banner", UserWarning, stacklevel=1)
        logging.getLogger("ray").error("a real error")
        print("our own table row")
    text = path.read_text()
    assert "Execution plan" in text and "a deprecation banner" in text and "a real error" in text
    out = capsys.readouterr()
    assert out.out == "our own table row\n"
    assert "a real error" in out.err and "Execution plan" not in out.err and "banner" not in out.err
    assert root.handlers == before  # restored
    capture_ray_loggers()  # idempotent
