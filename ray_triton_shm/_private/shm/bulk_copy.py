"""Large host copies split across threads.

One core's ``memcpy`` does not use all of a machine's memory bandwidth, and
the copies into and out of a slot are the only work the client does per
request at large payloads. On the 2-core dev machine, 128 MB into a shm
segment took 19.8 ms on one thread and 10.6 ms on two; out of one into a fresh
array, 32.2 ms and 17.5 ms. numpy releases the GIL while it copies.

Example:
    >>> copier = BulkCopier(threads=2)
    >>> src = np.ones(4 << 20, np.float32)
    >>> dst = np.empty_like(src)
    >>> copier.copy(dst, src)
    >>> copier.close()
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

__all__ = ["PART_MIN_BYTES", "BulkCopier", "default_copy_threads"]

PART_MIN_BYTES = 4 * 1024 * 1024
"""No thread copies less than this: below it, handing work over costs more than it saves."""

_ALIGN = 4096  # parts start on page boundaries, so no two threads touch one page


def default_copy_threads() -> int:
    """Threads for one copy when the config leaves it open: the usable cores, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


class BulkCopier:
    """Copies large contiguous arrays with up to ``threads`` threads at once.

    The calling thread copies one part itself; helper threads take the others
    while they are free. Helpers busy with one caller's copy are not promised
    to another: when many callers copy at once (the cores are busy anyway),
    each copies on its own thread, without hand-offs. Thread-safe.

    Args:
        threads: Threads per copy, the caller's included; 1 copies inline only.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._helpers_lent = 0
        self._closed = False

    def close(self) -> None:
        """Stop the helper threads (after the parts already handed over). Idempotent.

        Copies after ``close`` still work, on the calling thread alone.
        """
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _borrow(self, wanted: int) -> tuple[ThreadPoolExecutor | None, int]:
        """Up to ``wanted`` idle helpers (and the executor they run on); give them back with ``_return``."""
        with self._lock:
            if self._closed or wanted < 1:
                return None, 0
            granted = min(wanted, self.threads - 1 - self._helpers_lent)
            if granted < 1:
                return None, 0
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="rtshm-copy")
            self._helpers_lent += granted
            return self._executor, granted

    def _return(self, count: int) -> None:
        with self._lock:
            self._helpers_lent -= count

    def parts(self, nbytes: int) -> int:
        """How many pieces a copy of ``nbytes`` is split into."""
        return max(1, min(self.threads, nbytes // PART_MIN_BYTES))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``np.copyto(dst, src, casting="no")``, split across threads when large.

        Only arrays of one dtype and shape that are both C-contiguous are split;
        anything else is one ``np.copyto``. Returns once every part is written.

        Raises:
            TypeError / ValueError: From ``np.copyto`` (dtypes or shapes differ).
        """
        pieces = self.parts(src.nbytes)
        if (
            pieces == 1
            or dst.dtype != src.dtype
            or dst.shape != src.shape
            or not (dst.flags.c_contiguous and src.flags.c_contiguous)
        ):
            np.copyto(dst, src, casting="no")
            return
        helpers, granted = self._borrow(pieces - 1)
        if helpers is None:
            np.copyto(dst, src, casting="no")
            return
        try:
            self._split_copy(helpers, dst, src, granted + 1)
        finally:
            self._return(granted)

    @staticmethod
    def _split_copy(helpers: ThreadPoolExecutor, dst: np.ndarray, src: np.ndarray, pieces: int) -> None:
        dst_bytes = dst.reshape(-1).view(np.uint8)
        src_bytes = src.reshape(-1).view(np.uint8)
        step = -(-src.nbytes // pieces // _ALIGN) * _ALIGN
        bounds = [(start, min(start + step, src.nbytes)) for start in range(0, src.nbytes, step)]
        futures: list[Future[None]] = []
        inline = bounds[:1]
        try:
            for start, stop in bounds[1:]:
                try:
                    futures.append(helpers.submit(np.copyto, dst_bytes[start:stop], src_bytes[start:stop]))
                except RuntimeError:  # closed meanwhile: this part is ours too
                    inline.append((start, stop))
            for start, stop in inline:
                np.copyto(dst_bytes[start:stop], src_bytes[start:stop])
        finally:
            # Never return while a helper may still be writing into ``dst``.
            wait(futures)
        for future in futures:
            future.result()
