"""A Triton Inference Server process: find, start, wait until ready, stop.

Example:
    >>> from ray_triton_shm import ServerConfig, TritonServer
    >>> with TritonServer(ServerConfig(model_repository="deployments/models")) as server:
    ...     print(server.grpc_url, server.version)   # doctest: +SKIP
    127.0.0.1:40123 2.51.0

The server binds to loopback on free ports, dies with its parent
(``PR_SET_PDEATHSIG``), keeps a bounded tail of its log, and on stop removes
the shared-memory segments its Python backend leaves behind, and the
backend's directory in ``/tmp`` when the server did not exit cleanly.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.triton.process import (
    PDEATHSIG_SHIM,
    PythonEnvTurn,
    exit_code,
    kill_group,
    kill_group_leftovers,
    popen_from_launcher,
    remove_python_env,
    wait_exit,
)
from ray_triton_shm._private.triton.server_env import LaunchPlan, cpu_fallback_warning, find_tritonserver
from ray_triton_shm._private.triton.server_launch import SHM_API_GRPC_HEADER, ServerLaunch, ports_clashed
from ray_triton_shm._private.triton.server_launch import SHM_API_HEADER as SHM_API_HEADER
from ray_triton_shm._private.triton.server_launch import free_ports as free_ports
from ray_triton_shm.config import ServerConfig
from ray_triton_shm.errors import ServerError, ServerStartError

__all__ = ["TritonServer", "find_tritonserver"]

logger = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TritonServer(ServerLaunch):
    """One ``tritonserver`` process.

    When ``config.protect_shm_api`` is on (or auto and the host is not
    loopback), ``shm_api_key`` holds the random key its shared-memory endpoints
    require; give it to clients as ``ClientConfig.shm_api_key``.

    Args:
        config: Server configuration; keyword overrides are applied on top.
        **overrides: Fields of :class:`ServerConfig` to replace.

    Raises:
        ConfigError: Invalid configuration.
    """

    def __init__(self, config: ServerConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = ServerConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=config.log_tail_lines)
        self._plan: LaunchPlan | None = None
        self._python_setup_reason = ""
        self._resolved: ServerConfig | None = None
        self._backend_prefix = ""
        # Locked while Triton runs; guards the Python backend's files (named with it + "_"),
        # which Triton never locks, from sweepers in other pid namespaces.
        self._backend_guard: segment.Segment | None = None
        self._python_env: str | None = None  # the Python backend's directory, removed if Triton cannot
        self.version: str = ""
        self.restarts = 0
        # Called with (pid, process_marker) right after each launch, before the server is ready.
        self.on_launch: Callable[[int, str], None] | None = None
        # Called with python_env once it is known, after each launch: as soon as the backend made
        # it (so that a start that fails or is killed leaves none), and again once the server is ready.
        self.on_python_env: Callable[[str | None], None] | None = None
        protect = config.protect_shm_api
        if protect is None:
            protect = not _is_loopback(config.host)
        # Kept across restarts, so that whoever holds it keeps working.
        self.shm_api_key: str | None = secrets.token_urlsafe(24) if protect else None

    # -- addresses ---------------------------------------------------------
    def _require_resolved(self) -> ServerConfig:
        if self._resolved is None:
            raise ServerError("the server has not been started")
        return self._resolved

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        c = self._require_resolved()
        return f"{c.host}:{c.grpc_port}"

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        c = self._require_resolved()
        return f"{c.host}:{c.http_port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics``."""
        c = self._require_resolved()
        return f"http://{c.host}:{c.metrics_port}/metrics"

    @property
    def shm_api_headers(self) -> dict[str, str] | None:
        """gRPC headers that open the protected shared-memory endpoints; ``None`` if unprotected."""
        return {SHM_API_GRPC_HEADER: self.shm_api_key} if self.shm_api_key else None

    @property
    def python_env(self) -> str | None:
        """The directory Triton's Python backend made for this server (``/tmp/python_env_*``; the
        backend removes it when the server exits cleanly, :meth:`stop` when it did not), or ``None``:
        no backend loaded when it became ready, or the directory could not be told apart from
        another server's made meanwhile."""
        return self._python_env

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def process_marker(self) -> str:
        """Text on the command line of the running server and of its backend stubs ("" when stopped).

        The Python backend's region prefix: 128 random bits, so a process that
        shows it belongs to this server (see :attr:`on_launch`).
        """
        return self._backend_prefix if self._proc is not None else ""

    @property
    def binary_source(self) -> str:
        """Where the binary came from (explicit, PATH, system, embedded)."""
        return self._plan.source if self._plan else ""

    @property
    def warnings(self) -> list[str]:
        """What an operator must know about this server (a CPU-only fallback on a GPU machine)."""
        fallback = cpu_fallback_warning(self._plan) if self._plan else None
        return [fallback] if fallback else []

    def is_alive(self) -> bool:
        """Whether the process exists (a stopped or hung one counts as alive; see :meth:`probe`)."""
        return self._proc is not None and exit_code(self._proc) is None

    def probe(self, timeout: float = 1.0) -> bool:
        """Whether the server answers live and ready over HTTP, each within ``timeout`` seconds.

        A fresh connection per probe: a hung (or stopped) server accepts it in
        the kernel but never answers, so this returns False after ``timeout``.
        Never raises for an unreachable or unready server.
        """
        if self._resolved is None or not self.is_alive():
            return False
        try:
            self._http_json("/v2/health/live", timeout=timeout)
            self._http_json("/v2/health/ready", timeout=timeout)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return False
        return True

    def log_tail(self, lines: int | None = None) -> str:
        """The last ``lines`` lines the server printed (all kept lines by default)."""
        kept = list(self._log)
        return "\n".join(kept if lines is None else kept[-lines:])

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> TritonServer:
        """Start the server and wait until it is ready.

        Ports given as 0 are chosen free; on a restart the previous ports are
        tried first.

        Returns:
            self.

        Raises:
            ServerNotFoundError: No binary.
            ServerStartError: The server exited or was not ready in time.
        """
        with self._lock:
            if self.is_alive():
                return self
            sweep.sweep_stale_segments()
            if self._plan is None:
                self._plan = find_tritonserver(self.config)
                logger.info("using tritonserver %s (%s)", self._plan.binary, self._plan.source)
                fallback = cpu_fallback_warning(self._plan)
                if fallback:
                    logger.warning(fallback)
            attempts = 3
            for attempt in range(attempts):
                self._resolved = self._resolve_ports(fresh=attempt > 0)
                try:
                    with PythonEnvTurn() as turn:  # launches take turns until their directories appear
                        self._launch()
                        self._wait_ready(turn)
                        if self._proc is not None:
                            self._python_env = turn.finish(self._proc.pid)
                    self._tell_python_env()
                    return self
                except ServerStartError as e:
                    self._terminate()
                    if not ports_clashed(e.log_tail) or attempt == attempts - 1:
                        raise
                    logger.warning("tritonserver could not bind its ports; retrying")
        raise AssertionError("unreachable")

    def restart(self, *, kill: bool = False) -> TritonServer:
        """Stop (if running) and start again, keeping the ports when possible.

        Args:
            kill: SIGKILL the old process at once (for a hung server) instead of
                asking it to stop first.

        Returns:
            self.

        Raises:
            ServerNotFoundError / ServerStartError: As :meth:`start`.
        """
        with self._lock:
            self._terminate(kill=kill)
            self.restarts += 1
            return self.start()

    def stop(self) -> None:
        """Stop with SIGINT (a stopped process is continued to see it), then SIGKILL after
        ``stop_timeout_s``. Idempotent."""
        with self._lock:
            self._terminate()

    def kill(self) -> None:
        """SIGKILL the server and its process group (works on a stopped or hung one), reap it,
        remove its Python-backend segments. Idempotent."""
        with self._lock:
            self._terminate(kill=True)

    close = stop

    def _launch(self) -> None:
        plan, resolved = self._plan, self._resolved
        if plan is None or resolved is None:  # start() resolves both first
            raise ServerStartError("tritonserver launched before its binary and ports were resolved")
        self._backend_guard = segment.Segment.create(segment.new_segment_name("pyb"), 1)
        self._backend_prefix = f"{self._backend_guard.name}_"
        try:
            command = self._command(plan, resolved)
            shown = " ".join(command)
            if self.shm_api_key:
                shown = shown.replace(self.shm_api_key, "***")
            logger.info("starting tritonserver: %s", shown)
            self._log.clear()
            # close_fds (the default, said here on purpose) keeps segment lock fds out of
            # Triton: a lock inherited by the server would outlive its owner.
            self._proc = popen_from_launcher(
                [sys.executable, "-I", "-S", "-c", PDEATHSIG_SHIM, str(os.getpid()), *command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._environment(plan),
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            self._release_backend_segments()
            raise
        if self.on_launch is not None:
            try:
                self.on_launch(self._proc.pid, self._backend_prefix)
            except Exception:
                logger.exception("the launch listener failed")
        self._reader = threading.Thread(
            target=self._pump_log, args=(self._proc,), name="tritonserver-log", daemon=True
        )
        self._reader.start()

    def _pump_log(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.stdout is None:  # started without a pipe: nothing to read
            return
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if self.shm_api_key:  # Triton echoes a flag it cannot parse; the tail ends up in errors
                line = line.replace(self.shm_api_key, "***")
            self._log.append(line)
            logger.debug("tritonserver: %s", line)

    def _http_json(self, path: str, timeout: float = 2.0) -> Any:
        with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def _wait_ready(self, turn: PythonEnvTurn | None = None) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            code = exit_code(self._proc) if self._proc is not None else None
            if turn is not None and self._proc is not None and code is None and self._python_env is None:
                turn.look(self._proc.pid)
                if turn.path is not None:  # removed by _terminate if the start fails from here on
                    self._python_env = turn.path
                    self._tell_python_env()
            if self._proc is None or code is not None:
                self._join_reader()
                raise ServerStartError(
                    f"tritonserver exited with code {code} before it was ready", self.log_tail(60)
                )
            try:
                self._http_json("/v2/health/ready", timeout=1.0)
                # Ready over HTTP is not yet accepting on gRPC (seen after a restart on a loaded machine).
                c = self._require_resolved()
                socket.create_connection((c.host, c.grpc_port), timeout=1.0).close()
                self.version = str(self._http_json("/v2").get("version", ""))
                logger.info(
                    "tritonserver %s ready (pid %s) at grpc %s, http %s",
                    self.version,
                    self.pid,
                    self.grpc_url,
                    self.http_url,
                )
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"tritonserver was not ready within {self.config.startup_timeout_s:g} s",
                    self.log_tail(60),
                )
            # More often while the backend's directory is looked for: an owner killed before the
            # look leaves it unknown.
            time.sleep(0.02 if turn is not None and turn.held else 0.1)

    def _tell_python_env(self) -> None:
        if self.on_python_env is not None:
            try:
                self.on_python_env(self._python_env)
            except Exception:
                logger.exception("the python_env listener failed")

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _terminate(self, kill: bool = False) -> None:
        proc = self._proc
        if proc is not None:
            if not kill and exit_code(proc) is None:
                try:
                    os.kill(proc.pid, signal.SIGINT)
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process handles SIGINT only once continued
                except ProcessLookupError:
                    pass
                if not wait_exit(proc, self.config.stop_timeout_s):
                    logger.warning("tritonserver ignored SIGINT for %gs; killing", self.config.stop_timeout_s)
            # Always the whole group: a server that crashed leaves its backend stubs running.
            kill_group(proc)
            # A leader reaped before (a crash noticed by a poll) leaves no group to signal: its
            # stubs, still holding the log pipe open, are found by their group id instead.
            kill_group_leftovers(proc.pid)
            self._join_reader()
            if proc.stdout is not None:
                if self._reader is not None and self._reader.is_alive():
                    logger.warning(
                        "tritonserver's log pipe is still open after it exited; left to its reader"
                    )
                else:
                    proc.stdout.close()
        self._proc = None
        self._release_backend_segments()
        if self._python_env is not None:  # a server that exited cleanly removed it itself
            remove_python_env(self._python_env)
            self._python_env = None

    def _release_backend_segments(self) -> None:
        """Remove the Python backend's files (the prefix has 128 random bits), then their guard."""
        if self._backend_prefix:
            removed = sweep.unlink_with_prefix(self._backend_prefix)
            if removed:
                logger.debug("removed %d Python-backend segment(s)", len(removed))
            self._backend_prefix = ""
        if self._backend_guard is not None:
            self._backend_guard.close()
            self._backend_guard = None
