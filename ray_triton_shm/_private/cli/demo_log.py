"""Quiet demo output: our own progress and tables on the terminal, everyone else's chatter in a file.

Ray's, Ray Data's and Serve's INFO lines, Python warnings and this package's
INFO logs go to a log file; errors still reach stderr. The demo prints the
file's path at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_NOISY = ("ray", "ray.data", "ray.serve", "ray.train", "ray.tune", "py.warnings")


def demo_log_path() -> Path:
    """A fresh log file path under the temp directory (``ray-triton-shm/demo-<time>-<pid>.log``)."""
    directory = Path(tempfile.gettempdir()) / "ray-triton-shm"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def capture_ray_loggers() -> None:
    """Send Ray's own loggers (which it gives stderr handlers of their own) through the root's handlers.

    Call again after ``ray.init``: Ray configures its loggers when it starts.
    """
    for name in _NOISY:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


@contextlib.contextmanager
def quiet_logs(path: Path | None = None) -> Iterator[Path]:
    """Route logging and warnings to a file (errors also to stderr) for the block.

    Yields:
        The log file's path.
    """
    path = path or demo_log_path()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    to_file = logging.FileHandler(path)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    errors.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [to_file, errors]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    # Ray Data's progress bars write straight to the terminal; the demo prints its own progress.
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    try:
        capture_ray_loggers()
    except Exception:  # pragma: no cover - Ray not importable is fine here
        pass
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.handlers, level = saved
        root.setLevel(level)
        to_file.close()
