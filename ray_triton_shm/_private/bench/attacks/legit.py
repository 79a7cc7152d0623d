"""Legitimate callers: processes of their own calling ``identity`` with unmodified tritonclient, checking
every output, and reporting each call (when it started and ended, and how) to the process that judges.

Three kinds (each a ``protocol`` of :class:`Call`): ``http`` and ``grpc`` make one call at a time;
``grpc-streams`` makes :data:`STREAMS` calls at once on one channel (several HTTP/2 streams of one
connection, as ``perf_analyzer`` and an asyncio client do).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc
import tritonclient.http

N = 65536
"""Elements of each caller's FP32 ``[1, N]`` tensor (256 KB: through a slot)."""
CALL_TIMEOUT_S = 30.0
STREAMS = 2
"""Calls a ``grpc-streams`` caller makes at once on its channel."""
PROTOCOLS = ("http", "grpc", "grpc-streams")


@dataclass(frozen=True, kw_only=True)
class Call:
    """One legitimate call.

    Attributes:
        protocol: One of :data:`PROTOCOLS`.
        start: When it began (``time.time()``).
        end: When it ended.
        ok: Answered and right.
        error: The error, or ``wrong answer``, else ``""``.
    """

    protocol: str
    start: float
    end: float
    ok: bool
    error: str = ""


def _caller(protocol: str, url: str, pause_s: float, events, stop, go, in_flight) -> None:
    client_module = tritonclient.http if protocol == "http" else tritonclient.grpc
    call = _calls_at_once if protocol == "grpc-streams" else _call
    rng = np.random.default_rng()
    client = None
    while not stop.is_set():
        if not go.wait(0.2):
            continue
        with in_flight.get_lock():  # checked and counted at once: pause() then waits for this call
            if not go.is_set():
                continue
            in_flight.value += 1
        try:
            client = call(client_module, protocol, url, rng, events, client)
        finally:
            with in_flight.get_lock():
                in_flight.value -= 1
        if pause_s:
            time.sleep(pause_s)
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def _call(client_module, protocol: str, url: str, rng: np.random.Generator, events, client):
    """One call, reported on ``events``; returns the client to use next (``None`` after an error)."""
    x = rng.random((1, N), dtype=np.float32)
    start = time.time()
    error = ""
    try:
        if client is None:
            if protocol == "http":
                client = client_module.InferenceServerClient(
                    url, connection_timeout=CALL_TIMEOUT_S, network_timeout=CALL_TIMEOUT_S
                )
            else:
                client = client_module.InferenceServerClient(url)
        tensor = client_module.InferInput("INPUT0", [1, N], "FP32")
        tensor.set_data_from_numpy(x)
        if protocol == "http":
            result = client.infer("identity", [tensor])
        else:
            result = client.infer("identity", [tensor], client_timeout=CALL_TIMEOUT_S)
        if not np.array_equal(result.as_numpy("OUTPUT0"), x):
            error = "wrong answer"
    except Exception as e:
        error = f"{type(e).__name__}: {str(e)[:200]}"
        with contextlib.suppress(Exception):
            client.close()
        client = None
    events.put((protocol, start, time.time(), not error, error))
    return client


def _calls_at_once(client_module, protocol: str, url: str, rng: np.random.Generator, events, client):
    """:data:`STREAMS` calls at once on one gRPC client, each reported on ``events``; returns the
    client to use next (``None`` after an error)."""
    if client is None:
        client = client_module.InferenceServerClient(url)
    done = threading.Semaphore(0)
    results: list[tuple[float, float, str]] = []

    def call(x: np.ndarray, start: float) -> None:
        def finished(result, error) -> None:
            if error is not None:
                outcome = f"{type(error).__name__}: {str(error)[:200]}"
            elif not np.array_equal(result.as_numpy("OUTPUT0"), x):
                outcome = "wrong answer"
            else:
                outcome = ""
            results.append((start, time.time(), outcome))
            done.release()

        tensor = client_module.InferInput("INPUT0", [1, N], "FP32")
        tensor.set_data_from_numpy(x)
        client.async_infer("identity", [tensor], finished, client_timeout=CALL_TIMEOUT_S)

    started = 0
    try:
        for _ in range(STREAMS):
            call(rng.random((1, N), dtype=np.float32), time.time())
            started += 1
    except Exception as e:
        results.append((time.time(), time.time(), f"{type(e).__name__}: {str(e)[:200]}"))
    for _ in range(started):
        done.acquire(timeout=CALL_TIMEOUT_S + 5)
    for start, end, error in list(results):
        events.put((protocol, start, end, not error, error))
    if any(error for _, _, error in results) or len(results) < STREAMS:
        with contextlib.suppress(Exception):
            client.close()
        client = None
    return client


class LegitCallers:
    """A caller process of each of :data:`PROTOCOLS` (``per_protocol`` of each) on one server, calling until
    stopped.

    Args:
        http_url: The server's HTTP ``host:port``.
        grpc_url: Its gRPC ``host:port``.
        per_protocol: Caller processes of each protocol.
        pause_s: Each caller's pause between calls (keeps a 2-core machine from being only callers).
    """

    def __init__(self, http_url: str, grpc_url: str, *, per_protocol: int = 1, pause_s: float = 0.05) -> None:
        context = multiprocessing.get_context("spawn")
        self._events = context.Queue()
        self._stop = context.Event()
        self._go = context.Event()
        self._go.set()
        self._in_flight = context.Value("i", 0)
        self._processes = [
            context.Process(
                target=_caller,
                args=(protocol, url, pause_s, self._events, self._stop, self._go, self._in_flight),
                daemon=True,
            )
            for protocol in PROTOCOLS
            for url in [http_url if protocol == "http" else grpc_url]
            for _ in range(per_protocol)
        ]
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._collector = threading.Thread(target=self._collect, name="legit-calls", daemon=True)
        self._running = False

    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Start the callers; return once each protocol has had a right answer.

        Raises:
            TimeoutError: No right answer of a protocol within ``ready_timeout_s``.
        """
        self._running = True
        for p in self._processes:
            p.start()
        self._collector.start()
        deadline = time.monotonic() + ready_timeout_s
        while not all(self.served_since(0.0, p) for p in PROTOCOLS):
            if time.monotonic() > deadline:
                errors = {c.error for c in self.snapshot() if c.error}
                raise TimeoutError(f"the legitimate callers got no right answer: {sorted(errors)[:3]}")
            time.sleep(0.1)

    def _collect(self) -> None:
        while self._running or any(p.is_alive() for p in self._processes):
            try:
                protocol, start, end, ok, error = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            with self._lock:
                self.calls.append(Call(protocol=protocol, start=start, end=end, ok=ok, error=error))

    def snapshot(self) -> list[Call]:
        """Every call reported so far."""
        with self._lock:
            return list(self.calls)

    def served_since(self, since: float, protocol: str) -> bool:
        """Whether a ``protocol`` call that began at ``since`` or later was answered right."""
        return any(c.ok and c.protocol == protocol and c.start >= since for c in self.snapshot())

    def pause(self, timeout_s: float = CALL_TIMEOUT_S + 5) -> None:
        """Make no more calls until :meth:`resume`; return once no call is in flight.

        Raises:
            TimeoutError: A call still in flight after ``timeout_s``.
        """
        self._go.clear()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._in_flight.get_lock():
                if self._in_flight.value == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"a legitimate call still in flight {timeout_s:.0f} s after pause")
            time.sleep(0.02)

    def resume(self) -> None:
        """Call again after :meth:`pause`."""
        self._go.set()

    def stop(self) -> None:
        """Stop every caller (each ends its call in flight; killed after ``CALL_TIMEOUT_S``)."""
        self._stop.set()
        for p in self._processes:
            p.join(timeout=CALL_TIMEOUT_S + 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._running = False
        self._collector.join(timeout=5)

    def __enter__(self) -> LegitCallers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def longest_gap(calls: list[Call], protocol: str, start: float, end: float) -> float:
    """The longest stretch within [``start``, ``end``] in which no ``protocol`` call ended right."""
    ends = sorted(c.end for c in calls if c.ok and c.protocol == protocol and start <= c.end <= end)
    points = [start, *ends, end]
    return max(b - a for a, b in itertools.pairwise(points))
