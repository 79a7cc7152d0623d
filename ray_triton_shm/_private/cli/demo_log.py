"""Quiet demo output: our own progress and tables on the terminal, everyone else's chatter in a file.

Ray's, Ray Data's and Serve's INFO lines, Python warnings and this package's
INFO logs go to a log file; errors still reach stderr. The demo prints the
file's path at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_NOISY = ("ray", "ray.data", "ray.serve", "ray.train", "ray.tune", "py.warnings")


def demo_log_dir() -> Path:
    """This user's private log directory: ``<temp dir>/ray-triton-shm-<uid>``, mode 0700.

    A name in a shared temp directory can be taken first by another user (a
    directory open to all, or a link to elsewhere). The directory is used only
    if it is a real directory of this user that nobody else may enter; anything
    else under that name makes this call use a fresh, unguessable directory
    instead (``tempfile.mkdtemp``, also 0700).
    """
    uid = os.getuid()
    directory = Path(tempfile.gettempdir()) / f"ray-triton-shm-{uid}"
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not stat.S_IMODE(info.st_mode) & 0o077:
        return directory
    return Path(tempfile.mkdtemp(prefix=f"ray-triton-shm-{uid}-"))


def demo_log_path() -> Path:
    """A fresh log file path in :func:`demo_log_dir` (``demo-<time>-<pid>.log``)."""
    return demo_log_dir() / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


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
