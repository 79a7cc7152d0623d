"""The front door's calls: counted for Serve's autoscaler, bounded by ``max_ongoing_requests``, observed.

Serve counts, bounds, measures and logs the requests its router hands a
replica; the front door's calls never pass that router, so the door does the
same for its own: :class:`CallGate` counts the calls working (reported to
Serve's autoscaler), refuses one past the deployment's ``max_ongoing_requests``
and hands each finished call to an observer (Serve's metrics and access log).
As Serve's proxy reads a request whole before a replica counts it, and writes
the answer after the replica is done with it, a call counts only from its
complete request to its computed answer: clients that send or read slowly
never hold the bound. Nor does a call that runs in one slot count while it
waits for the slot (:meth:`GatedCall.wait_for`): the calls holding the slots
may be waiting on their own clients, and calls queued behind them would
otherwise fill the bound. (A request the node client spreads over several
slots, or of BYTES tensors, still counts while ``infer`` waits for its slots.)

Serve's autoscaler counts the requests queued at its handles as well as those
the replicas work on; so the door's demand (:meth:`CallGate.mean_demand`,
what a replica reports to the autoscaler) is its calls working and its calls
waiting for a slot, averaged over time since the previous report.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ray_triton_shm.errors import OverloadedError


@dataclass
class CallRecord:
    """One front-door call, as its observer sees it once it ends.

    Attributes:
        protocol: ``http`` or ``grpc``.
        method: The HTTP method, or the gRPC method's name (``ModelInfer``, ...).
        route: The HTTP path, or the gRPC method's path.
        status: The HTTP status code, or the gRPC status name (``OK``, ``UNAVAILABLE``, ...);
            empty when the call ended without an answer (the client went).
        latency_s: From the call's start to its end.
    """

    protocol: str
    method: str
    route: str
    status: str = ""
    latency_s: float = 0.0


Observer = Callable[[CallRecord], None]
_T = TypeVar("_T")


class GatedCall:
    """One call through a :class:`CallGate`: observed from its start to its end, counted only while it works.

    A call works (counts against the gate's bound) from its complete request to
    its computed answer: never while it waits on its client (a body still
    arriving, an answer the client takes slowly), so slow clients cannot hold
    the bound.

    Attributes:
        record: The call's record; the caller sets its ``status``.
    """

    def __init__(self, gate: CallGate, record: CallRecord) -> None:
        self._gate = gate
        self.record = record
        self._counted = False
        self._admitted = False

    @contextlib.contextmanager
    def running(self) -> Iterator[GatedCall]:
        """Count the call while the block runs (or until :meth:`leave`).

        Raises:
            OverloadedError: The gate's bound of calls is working already.
        """
        self._gate._enter(self)
        try:
            yield self
        finally:
            self.leave()

    def wait_for(self, take: Callable[[], _T], give_back: Callable[[_T], object]) -> _T:
        """``take()`` (a slot), the call not counted while it waits: it waits on other calls, not works.

        While it waits it is part of the gate's demand (:meth:`CallGate.mean_demand`),
        not of its bound. A call counted before counts again once ``take`` returns.

        Raises:
            OverloadedError: The bound was reached while it waited (what ``take`` returned has
                gone to ``give_back``).
            Exception: Whatever ``take`` raises.
        """
        counted = self._counted
        self.leave()
        self._gate._wait(1)
        try:
            taken = take()
        finally:
            self._gate._wait(-1)
        if counted:
            try:
                self._gate._enter(self)
            except BaseException:
                give_back(taken)
                raise
        return taken

    def leave(self) -> None:
        """Stop counting the call (its answer is computed); idempotent."""
        if self._counted:
            self._counted = False
            self._gate._leave()


class CallGate:
    """Counts the calls a replica's front door works on, and refuses one past ``limit``.

    Args:
        limit: Calls working at once (``None``: no bound).
        observer: Called with each call's record once it ends (also a refused one's),
            in the call's thread; it must be quick and must not raise.
        clock: Seconds, for :meth:`mean_demand`.
    """

    def __init__(
        self,
        limit: int | None = None,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.observer = observer
        self._clock = clock
        self._lock = threading.Lock()
        self._ongoing = 0
        self._waiting = 0
        self._total = 0
        self._refused = 0
        self._since = self._changed = clock()  # the window of mean_demand; the demand's last change
        self._area = 0.0  # demand times seconds, since _since

    @contextlib.contextmanager
    def call(self, protocol: str = "", method: str = "", route: str = "") -> Iterator[GatedCall]:
        """One call, observed once it ends; it counts only inside :meth:`GatedCall.running`."""
        call = GatedCall(self, CallRecord(protocol, method, route))
        start = time.perf_counter()
        try:
            yield call
        finally:
            call.leave()
            self._observe(call.record, start)

    @contextlib.contextmanager
    def running(self, protocol: str = "", method: str = "", route: str = "") -> Iterator[GatedCall]:
        """One call counted for as long as it lasts (a call with no client to wait on).

        Raises:
            OverloadedError: ``limit`` calls are working already.
        """
        with self.call(protocol, method, route) as call, call.running():
            yield call

    def _enter(self, call: GatedCall) -> None:
        if call._counted:
            return
        with self._lock:
            full = self.limit is not None and self._ongoing >= self.limit
            if full:
                self._refused += 1
            else:
                self._account()
                self._ongoing += 1
                call._counted = True
                if not call._admitted:
                    call._admitted = True
                    self._total += 1
        if full:
            call.record.status = "503" if call.record.protocol == "http" else "UNAVAILABLE"
            raise OverloadedError(self.limit or 0)

    def _leave(self) -> None:
        with self._lock:
            self._account()
            self._ongoing -= 1

    def _wait(self, change: int) -> None:
        with self._lock:
            self._account()
            self._waiting += change

    def _account(self) -> None:
        """Add the demand until now to the window's area (under the lock, before a change)."""
        now = self._clock()
        self._area += (self._ongoing + self._waiting) * (now - self._changed)
        self._changed = now

    def mean_demand(self) -> float:
        """Calls working or waiting for a slot, on average since the previous call (or the start).

        What a replica reports to Serve's autoscaler: one reader, as each call starts a new window.
        """
        with self._lock:
            self._account()
            elapsed = self._changed - self._since
            mean = self._area / elapsed if elapsed > 0 else float(self._ongoing + self._waiting)
            self._since, self._area = self._changed, 0.0
        return mean

    def _observe(self, record: CallRecord, start: float) -> None:
        if self.observer is not None:
            record.latency_s = time.perf_counter() - start
            self.observer(record)

    @property
    def ongoing(self) -> int:
        """Calls working now."""
        return self._ongoing

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot now (not counted against ``limit``)."""
        return self._waiting

    @property
    def total(self) -> int:
        """Calls let in since the door opened."""
        return self._total

    @property
    def refused(self) -> int:
        """Calls refused for the bound since the door opened."""
        return self._refused
