"""What a ``tritonserver`` process is launched with: its ports, its command line, its environment.

:class:`ServerLaunch` is the part of :class:`~ray_triton_shm.server.TritonServer` that
chooses the ports (free ones for those given as 0; the previous ones first on a restart,
fresh ones after a clash), writes the command line (the Python backend's region prefix, client shared
memory where the binary takes it, the shared-memory endpoints restricted to the server's
key) and the environment (the Python-backend setup where the repository needs it, the
GPUs); the server sets up the state it uses and runs the process. :func:`free_ports` and
:func:`ports_clashed` serve others too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import subprocess
from collections.abc import Collection

from ray_triton_shm._private.triton.repository import python_backend_models
from ray_triton_shm._private.triton.server_env import LaunchPlan
from ray_triton_shm.config import ServerConfig

# The server's messages, under the server's logger name wherever they are written.
logger = logging.getLogger("ray_triton_shm.server")

# Header that protected shared-memory endpoints expect over HTTP; over gRPC Triton
# expects it with a "triton-grpc-protocol-" prefix (metadata keys are lower case).
SHM_API_HEADER = "rtshm-shm-key"
SHM_API_GRPC_HEADER = f"triton-grpc-protocol-{SHM_API_HEADER}"
# What Triton prints when it cannot have its ports: taken by another process meanwhile, or
# two of its endpoints given the same one.
_PORT_CLASH_HINTS = (
    "address already in use",
    "failed to start",
    "failed to listen",
    "at the same address and port",
)


def ports_clashed(log_tail: str) -> bool:
    """Whether a server that failed to start says it could not have its ports (worth fresh ones)."""
    text = log_tail.lower()
    return any(hint in text for hint in _PORT_CLASH_HINTS)


def free_ports(host: str, count: int, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports free on ``host`` now, none of them in ``avoid``.

    Every port stays bound until all are chosen: the kernel may hand out a port
    it was just given back, so choosing them one by one can give one port twice.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


@functools.lru_cache(maxsize=16)
def _supported_flags(binary: str, library_path: str, mtime: float) -> str:
    """``tritonserver --help`` text, cached per binary (mtime is part of the key)."""
    env = dict(os.environ, LD_LIBRARY_PATH=library_path)
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


class ServerLaunch:
    """A server's ports, command line and environment (a base of ``TritonServer``, which sets it up)."""

    config: ServerConfig
    shm_api_key: str | None
    _resolved: ServerConfig | None
    _backend_prefix: str
    _python_setup_reason: str

    def _resolve_ports(self, *, fresh: bool) -> ServerConfig:
        base = self.config if fresh or self._resolved is None else self._resolved
        given = {name: getattr(base, name) for name in ("http_port", "grpc_port", "metrics_port")}
        chosen = iter(
            free_ports(
                self.config.host,
                sum(1 for port in given.values() if not port),
                avoid={port for port in given.values() if port},
            )
        )
        ports = {name: port or next(chosen) for name, port in given.items()}
        return dataclasses.replace(self.config, **ports)

    def _command(self, plan: LaunchPlan, resolved: ServerConfig) -> list[str]:
        flags = resolved.server_flags()
        flags.append(f"--backend-config=python,shm-region-prefix-name={self._backend_prefix}")
        flags.extend(plan.extra_flags)
        library_path = os.pathsep.join(plan.library_paths)
        help_text = _supported_flags(plan.binary, library_path, os.path.getmtime(plan.binary))
        if "--allow-client-shm" in help_text:
            flags.append("--allow-client-shm=true")
        if self.shm_api_key:
            restriction = f"shared-memory:{SHM_API_HEADER}={self.shm_api_key}"
            flags.append(f"--grpc-restricted-protocol={restriction}")
            flags.append(f"--http-restricted-api={restriction}")
        return [plan.binary, *flags]

    def _environment(self, plan: LaunchPlan) -> dict[str, str]:
        env = dict(os.environ)
        # The client's Python paths must not leak into the stub's interpreter.
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(name, None)
        python_setup = self._python_setup_wanted()
        if plan.path_prefix and (python_setup or self.config.python_env):  # an explicit env is a request
            env["PATH"] = os.pathsep.join([*plan.path_prefix, env.get("PATH", "")])
        if plan.library_paths:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                [*plan.library_paths, *filter(None, [env.get("LD_LIBRARY_PATH")])]
            )
        tunables = self.config.glibc_tunables(env.get("GLIBC_TUNABLES", "")) if python_setup else ""
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        if python_setup:
            logger.info(
                "Python-backend setup applied (%s): stub Python from %s, GLIBC_TUNABLES=%s",
                self._python_setup_reason,
                plan.path_prefix[0] if plan.path_prefix else "PATH",
                tunables or "(glibc defaults)",
            )
        else:
            logger.info("Python-backend setup not applied (%s)", self._python_setup_reason)
        if self.config.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.config.gpus)
        return env

    def _python_setup_wanted(self) -> bool:
        """Whether the Python-backend setup applies; the reason is kept for the log."""
        if self.config.python_backend is not None:
            self._python_setup_reason = f"ServerConfig.python_backend={self.config.python_backend}"
            return self.config.python_backend
        models = python_backend_models(self.config.model_repositories)
        if models is None:
            self._python_setup_reason = "a remote repository may hold Python-backend models"
            return True
        if models:
            shown = ", ".join(models[:5]) + (", ..." if len(models) > 5 else "")
            self._python_setup_reason = f"{len(models)} Python-backend model(s): {shown}"
            return True
        self._python_setup_reason = "no Python-backend models in the repository"
        return False
