"""Call records handed to their observer in batches, from a thread of its own.

Recording a call (two metrics and an access-log line through Serve's
handlers) costs the calls' threads several times more under load than alone
(``docs/benchmarks.md``, "Where the front door's time goes").
:class:`BatchedObserver` is the :class:`~ray_triton_shm._private.serve.door.calls.CallGate`'s
observer: a call's thread only appends its record (with the wall-clock time
it ended) to a queue, and one thread hands what has queued, in order, to the
real observer every ``every_s`` seconds. Nothing is lost: :meth:`BatchedObserver.close`
hands over what is left, and a record that comes after it is handed over at once. The
queue is bounded: a call that finds ``max_queued`` records queued hands them over
itself, so calls that come faster than their records are recorded (a flood of cheap
refused calls, say) pay for their own records.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from ray_triton_shm._private.serve.door.calls import CallRecord

logger = logging.getLogger(__name__)

RECORD_EVERY_S = 0.1
"""How often the queued records are handed over (so how late a record may be)."""
MAX_QUEUED = 1000
"""Records queued at most; the call that finds this many hands them over itself."""

Ended = tuple[CallRecord, float]
"""A call's record and the wall-clock time (``time.time()``) it ended."""


class BatchedObserver:
    """A call gate's observer that queues each record and hands them over in batches.

    Args:
        record_all: Takes a batch of records, oldest first (each with the time its call
            ended). Runs in the observer's own thread; what it raises is logged.
        every_s: How often the queue is handed over.
        max_queued: Records queued at most (see the module docstring).
        name: The thread's name.

    Raises:
        ValueError: ``every_s`` is not positive, or ``max_queued`` not at least 1.
    """

    def __init__(
        self,
        record_all: Callable[[Sequence[Ended]], None],
        *,
        every_s: float = RECORD_EVERY_S,
        max_queued: int = MAX_QUEUED,
        name: str = "frontdoor-observer",
    ) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be positive, not {every_s!r}")
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be an integer of at least 1, not {max_queued!r}")
        self._max_queued = max_queued
        self._record_all = record_all
        self._every_s = every_s
        self._queue: collections.deque[Ended] = collections.deque()
        self._handing = threading.Lock()  # one batch at a time, in order
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __call__(self, record: CallRecord) -> None:
        """Queue ``record`` (a call's thread: an append, nothing more); record the queue now after
        :meth:`close`, or when it holds ``max_queued`` records."""
        self._queue.append((record, time.time()))
        if self._closed.is_set() or len(self._queue) >= self._max_queued:
            self.flush()

    def flush(self) -> None:
        """Hand every record queued now to ``record_all``, in the caller's thread."""
        with self._handing:
            batch: list[Ended] = []
            while True:
                try:
                    batch.append(self._queue.popleft())
                except IndexError:
                    break
            if not batch:
                return
            try:
                self._record_all(batch)
            except Exception as e:  # a recording failure must not stop the recording of later calls
                logger.warning("front door: %d call records were not recorded: %r", len(batch), e)

    def _run(self) -> None:
        while not self._closed.wait(self._every_s):
            self.flush()

    @property
    def running(self) -> bool:
        """Whether the observer's thread is alive."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and hand over what is queued; idempotent."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self.flush()
