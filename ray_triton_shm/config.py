"""Configuration of the Triton server, the slot pools and the client.

All configuration objects are frozen, keyword-only dataclasses. A field that
is not given explicitly falls back to its ``RAY_TRITON_SHM_*`` environment
variable, then to its default (explicit > environment > default). Values are
validated when the object is built, and objects pickle, so they can be passed
to Ray actors as they are.

Example:
    >>> from ray_triton_shm.config import PoolConfig, ServerConfig
    >>> server = ServerConfig(model_repository="deployments/models")
    >>> pool = PoolConfig(slots=8, max_shapes={"INPUT0": (1024,)})
    >>> server.host, pool.slots
    ('127.0.0.1', 8)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ray_triton_shm._private.base.config_checks import require, require_type, string_tuple
from ray_triton_shm._private.base.env_fields import ENV_PREFIX as ENV_PREFIX
from ray_triton_shm._private.base.env_fields import (
    env_field,
    parse_int_tuple,
    parse_optional_bool,
    parse_optional_str,
    parse_str_tuple,
)
from ray_triton_shm.errors import ConfigError

__all__ = ["ClientConfig", "PoolConfig", "ServerConfig", "env_field"]

MEMORY_KINDS = ("system", "cuda")
# Twice this must still fit glibc's size_t trim threshold; far above any tensor.
_MAX_MMAP_THRESHOLD = 1 << 40


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How to start a Triton server.

    Fields with a ``flag`` in their metadata become ``tritonserver`` flags
    (see :meth:`server_flags`); the others steer this package.

    Attributes:
        model_repository: Models to serve: a directory, or a URI Triton reads
            itself (``s3://``, ``gs://``, ``as://``), passed through unchanged;
            a sequence of them serves several repositories at once.
        binary: Path of ``tritonserver``; when unset the binary is searched for
            (see ``ray_triton_shm.server.find_tritonserver``).
        python_env: A Python environment (venv prefix) with numpy < 2 for the
            Python-backend stub; when unset and the embedded server is used,
            one is provisioned in the cache directory.
        cache_dir: Where provisioned server environments are kept.
        host: Address HTTP, gRPC and metrics bind to. Keep it on loopback:
            anyone who reaches the shared-memory endpoints can make the server
            read any /dev/shm key.
        http_port / grpc_port / metrics_port: 0 picks a free port.
        log_verbose: Triton's verbose log level.
        exit_timeout_s: How long Triton waits for in-flight requests on exit.
        strict_readiness: Ready only once every model is loaded.
        python_shm_default_bytes / python_shm_growth_bytes: Sizes of the
            Python backend's own shared-memory arena; a small growth step
            makes large tensors slow.
        malloc_mmap_threshold_bytes: glibc's ``mmap_threshold`` for the server
            and its Python-backend stubs (``GLIBC_TUNABLES``; ``trim_threshold``
            is set to twice it). The stub copies every input tensor into a
            fresh numpy array; with glibc's default, one above 32 MiB is a new
            mapping each request, and the kernel zeroes every page of it
            (~14 ms of ~99 ms per 128 MB request here). Blocks below this
            size are kept and reused instead, so the server and each stub
            hold on to the memory of their largest request. 0 leaves glibc's
            defaults; a tunable already in the server's ``GLIBC_TUNABLES`` is
            kept.
        python_backend: Whether the Python-backend setup (the numpy<2 stub
            environment on ``PATH`` and the malloc thresholds above) is
            applied. ``None`` (auto): when a local repository has
            Python-backend models, or a repository is remote (unknown).
        model_control: ``none`` (Triton loads the repository at start and
            refuses load/unload) or ``explicit`` (every model is loaded at
            start, and models can be loaded, unloaded and reloaded while it
            runs: ``ray-triton-shm models``). ``load_models`` implies explicit.
        load_models: When set, only these models are loaded (explicit mode).
        gpus: ``CUDA_VISIBLE_DEVICES`` for the server; ``None`` inherits.
        startup_timeout_s: How long to wait for readiness.
        stop_timeout_s: How long to wait after SIGINT before SIGKILL.
        log_tail_lines: How many lines of server output are kept in memory.
        protect_shm_api: Restrict Triton's shared-memory endpoints (gRPC and
            HTTP register/unregister/status) to callers that send a random
            per-server key header (``TritonServer.shm_api_key``). ``None``
            (auto) turns it on when ``host`` is not loopback.
        extra_args: More flags, passed as they are.
    """

    model_repository: str | tuple[str, ...] = env_field("MODEL_REPOSITORY", "", flag="model-repository")
    binary: str | None = env_field("TRITONSERVER", None, parse_optional_str)
    python_env: str | None = env_field("SERVER_PYTHON_ENV", None, parse_optional_str)
    cache_dir: str = env_field("CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ray-triton-shm"))
    host: str = env_field("HOST", "127.0.0.1", flag=("http-address", "grpc-address", "metrics-address"))
    http_port: int = env_field("HTTP_PORT", 0, flag="http-port")
    grpc_port: int = env_field("GRPC_PORT", 0, flag="grpc-port")
    metrics_port: int = env_field("METRICS_PORT", 0, flag="metrics-port")
    log_verbose: int = env_field("LOG_VERBOSE", 0, flag="log-verbose")
    exit_timeout_s: int = env_field("EXIT_TIMEOUT_S", 5, flag="exit-timeout-secs")
    strict_readiness: bool = env_field("STRICT_READINESS", True, flag="strict-readiness")
    python_shm_default_bytes: int = env_field(
        "PYTHON_SHM_DEFAULT_BYTES",
        16 * 1024 * 1024,
        flag="backend-config=python,shm-default-byte-size",
    )
    python_shm_growth_bytes: int = env_field(
        "PYTHON_SHM_GROWTH_BYTES",
        64 * 1024 * 1024,
        flag="backend-config=python,shm-growth-byte-size",
    )
    malloc_mmap_threshold_bytes: int = env_field("MALLOC_MMAP_THRESHOLD_BYTES", 256 * 1024 * 1024)
    python_backend: bool | None = env_field("PYTHON_BACKEND", None, parse_optional_bool)
    model_control: str = env_field("MODEL_CONTROL", "none")
    load_models: tuple[str, ...] = env_field("LOAD_MODELS", (), parse_str_tuple)
    gpus: tuple[int, ...] | None = env_field("GPUS", None, lambda s: parse_int_tuple(s))
    startup_timeout_s: float = env_field("STARTUP_TIMEOUT_S", 120.0)
    stop_timeout_s: float = env_field("STOP_TIMEOUT_S", 10.0)
    log_tail_lines: int = env_field("LOG_TAIL_LINES", 200)
    protect_shm_api: bool | None = env_field("PROTECT_SHM_API", None, parse_optional_bool)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.model_repository, (list, tuple)):
            object.__setattr__(self, "model_repository", string_tuple(self, "model_repository"))
            require(
                bool(self.model_repository) and all(self.model_repository),
                "ServerConfig.model_repository needs at least one non-empty repository",
            )
        else:
            require(
                isinstance(self.model_repository, str) and bool(self.model_repository),
                "ServerConfig.model_repository is required (a path, a URI or a sequence of them)",
            )
        for name in (
            "http_port",
            "grpc_port",
            "metrics_port",
            "log_verbose",
            "exit_timeout_s",
            "malloc_mmap_threshold_bytes",
        ):
            require_type(self, name, int)
        for name in ("startup_timeout_s", "stop_timeout_s"):
            require_type(self, name, (int, float))
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            require(0 <= port <= 65535, f"ServerConfig.{name} must be in 0..65535, got {port}")
        require(self.log_verbose >= 0, "ServerConfig.log_verbose must be >= 0")
        require(self.exit_timeout_s >= 0, "ServerConfig.exit_timeout_s must be >= 0")
        require(self.startup_timeout_s > 0, "ServerConfig.startup_timeout_s must be > 0")
        require(self.stop_timeout_s > 0, "ServerConfig.stop_timeout_s must be > 0")
        require(self.log_tail_lines > 0, "ServerConfig.log_tail_lines must be > 0")
        require(self.python_shm_default_bytes > 0, "python_shm_default_bytes must be > 0")
        require(self.python_shm_growth_bytes > 0, "python_shm_growth_bytes must be > 0")
        require(
            0 <= self.malloc_mmap_threshold_bytes <= _MAX_MMAP_THRESHOLD,
            f"ServerConfig.malloc_mmap_threshold_bytes must be in 0..{_MAX_MMAP_THRESHOLD}, "
            f"got {self.malloc_mmap_threshold_bytes}",
        )
        require(bool(self.host), "ServerConfig.host must not be empty")
        if self.protect_shm_api is not None:
            require_type(self, "protect_shm_api", bool)
        require(
            self.model_control in ("none", "explicit"),
            f"ServerConfig.model_control must be none or explicit, got {self.model_control!r}",
        )
        if self.python_backend is not None:
            require_type(self, "python_backend", bool)
        if self.gpus is not None:
            require(all(g >= 0 for g in self.gpus), "ServerConfig.gpus must be >= 0")
        object.__setattr__(self, "load_models", string_tuple(self, "load_models"))
        object.__setattr__(self, "extra_args", string_tuple(self, "extra_args"))

    def server_flags(self) -> list[str]:
        """The ``tritonserver`` flags derived from the fields that carry one.

        Returns:
            Flags in ``--name=value`` form, in field order, followed by
            ``--load-model`` flags and ``extra_args``.
        """
        flags: list[str] = []
        for f in dataclasses.fields(self):
            names = f.metadata.get("flag")
            if not names:
                continue
            value = getattr(self, f.name)
            for flag_name in (names,) if isinstance(names, str) else names:
                for item in value if isinstance(value, tuple) else (value,):
                    text = str(item).lower() if isinstance(item, bool) else str(item)
                    flags.append(f"--{flag_name}={text}")
        if self.load_models:
            flags.append("--model-control-mode=explicit")
            flags.extend(f"--load-model={name}" for name in self.load_models)
        elif self.model_control == "explicit":
            flags += ["--model-control-mode=explicit", "--load-model=*"]
        flags.extend(self.extra_args)
        return flags

    @property
    def explicit_model_control(self) -> bool:
        """Whether Triton runs with explicit model control: loads and unloads allowed while it runs.

        ``model_control="explicit"`` or ``load_models`` turn it on; a
        ``--model-control-mode`` flag in ``extra_args`` (given last) decides.
        """
        mode = "explicit" if self.load_models or self.model_control == "explicit" else "none"
        args = list(self.extra_args)
        for index, arg in enumerate(args):
            if arg.startswith("--model-control-mode="):
                mode = arg.split("=", 1)[1]
            elif arg == "--model-control-mode" and index + 1 < len(args):
                mode = args[index + 1]
        return mode == "explicit"

    @property
    def model_repositories(self) -> tuple[str, ...]:
        """Every repository served, as a tuple."""
        repo = self.model_repository
        return repo if isinstance(repo, tuple) else (repo,)

    def glibc_tunables(self, inherited: str = "") -> str:
        """The ``GLIBC_TUNABLES`` value the server runs with.

        Args:
            inherited: The value in the environment the server starts from.

        Returns:
            ``inherited`` with the malloc thresholds of
            ``malloc_mmap_threshold_bytes`` appended, except any that
            ``inherited`` sets already; ``inherited`` unchanged when the field
            is 0.
        """
        if not self.malloc_mmap_threshold_bytes:
            return inherited
        entries = [entry for entry in inherited.split(":") if entry]
        present = {entry.split("=", 1)[0] for entry in entries}
        wanted = {
            "glibc.malloc.mmap_threshold": self.malloc_mmap_threshold_bytes,
            "glibc.malloc.trim_threshold": 2 * self.malloc_mmap_threshold_bytes,
        }
        entries.extend(f"{name}={value}" for name, value in wanted.items() if name not in present)
        return ":".join(entries)


# A BYTES element's length is a 4-byte unsigned integer in Triton's serialised form.
_MAX_ELEMENT_BYTES = (1 << 32) - 1

GRPC_MIN_SHM_BYTES = 64 * 1024
"""Below this, a shm request sent with tritonclient.grpc is slower than plain gRPC (docs/benchmarks.md)."""


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How to carve a model's shared-memory pool into slots.

    Attributes:
        slots: Number of slots; each holds one batch of every input and output.
        max_batch_size: Batch capacity of a slot; ``None`` takes the model's
            ``max_batch_size``. May only lower it.
        max_shapes: For tensors with variable (-1) dims, the largest shape
            (without the batch dim) a slot must hold, by tensor name.
        max_element_bytes: For BYTES (STRING) tensors, the longest element a
            slot holds: each element gets ``4 + max_element_bytes`` bytes
            (Triton's serialised form: a 4-byte length, then the bytes). A
            request with a longer input element, or whose BYTES output does
            not fit, goes over plain gRPC when ``ClientConfig.grpc_fallback``
            is on, else fails with a typed error.
        lease_timeout_s: How long ``infer`` waits for a free slot.
        min_shm_bytes: Requests whose inputs are smaller than this go over
            plain gRPC, where shared memory does not pay; 0 always uses shm.
            Ignored for CUDA pools and GPU inputs, which always use shm.
            ``None`` (the default) picks the measured crossover for the way
            shm requests are sent (:meth:`shm_threshold`): 0 over HTTP
            (``ClientConfig.http_url``), where shm wins at every size, and
            64 KiB over gRPC, below which a shm request through
            ``tritonclient.grpc`` costs ~0.1 ms more than gRPC's copy.
        memory: ``"system"`` (POSIX shared memory) or ``"cuda"`` (GPU memory
            shared with Triton through CUDA IPC; needs cupy, see docs/cuda.md).
        device_id: For ``"cuda"``: the GPU, as this process numbers it; ``None``
            takes cupy's current device.
    """

    slots: int = env_field("SLOTS", 4)
    max_batch_size: int | None = None
    max_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    max_element_bytes: int = env_field("MAX_ELEMENT_BYTES", 256)
    lease_timeout_s: float = env_field("LEASE_TIMEOUT_S", 30.0)
    min_shm_bytes: int | None = env_field("MIN_SHM_BYTES", None, lambda s: int(s) if s.strip() else None)
    memory: str = env_field("MEMORY", "system")
    device_id: int | None = env_field("DEVICE_ID", None, lambda s: int(s) if s.strip() else None)

    def __post_init__(self) -> None:
        require(
            self.memory in MEMORY_KINDS,
            f"PoolConfig.memory must be one of {list(MEMORY_KINDS)}, got {self.memory!r}",
        )
        if self.device_id is not None:
            require_type(self, "device_id", int)
            require(self.device_id >= 0, f"PoolConfig.device_id must be >= 0, got {self.device_id}")
        require_type(self, "slots", int)
        require_type(self, "max_element_bytes", int)
        require(
            1 <= self.max_element_bytes <= _MAX_ELEMENT_BYTES,
            f"PoolConfig.max_element_bytes must be in 1..{_MAX_ELEMENT_BYTES}, got {self.max_element_bytes}",
        )
        require_type(self, "lease_timeout_s", (int, float))
        if self.min_shm_bytes is not None:
            require_type(self, "min_shm_bytes", int)
        if self.max_batch_size is not None:
            require_type(self, "max_batch_size", int)
        require(self.slots >= 1, f"PoolConfig.slots must be >= 1, got {self.slots}")
        if self.max_batch_size is not None:
            require(
                self.max_batch_size >= 1,
                f"PoolConfig.max_batch_size must be >= 1, got {self.max_batch_size}",
            )
        require(self.lease_timeout_s > 0, "PoolConfig.lease_timeout_s must be > 0")
        require(
            self.min_shm_bytes is None or self.min_shm_bytes >= 0, "PoolConfig.min_shm_bytes must be >= 0"
        )
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in dict(self.max_shapes).items():
            try:
                dims = tuple(int(d) for d in shape)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"PoolConfig.max_shapes[{name!r}] must be a sequence of ints") from e
            require(
                all(d >= 1 for d in dims),
                f"PoolConfig.max_shapes[{name!r}] must have positive dims, got {shape!r}",
            )
            shapes[str(name)] = dims
        object.__setattr__(self, "max_shapes", shapes)

    def shm_threshold(self, *, over_http: bool, cuda: bool = False) -> int:
        """The input size from which ``infer`` uses shared memory.

        Args:
            over_http: Whether shm requests go over HTTP (``ClientConfig.http_url`` set).
            cuda: Whether the request involves GPU memory (a CUDA pool or a
                device input). Then it is always 0: plain gRPC would copy the
                tensors to host and return host arrays, which must not happen
                just because they are small (``infer_grpc`` does it on request).

        Returns:
            0 for GPU memory; else ``min_shm_bytes`` if set, else the crossover
            measured for that transport.
        """
        if cuda:
            return 0
        if self.min_shm_bytes is not None:
            return self.min_shm_bytes
        return 0 if over_http else GRPC_MIN_SHM_BYTES


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How a client reaches Triton and sizes its pools.

    Attributes:
        url: Triton's gRPC address, ``host:port``.
        http_url: Triton's HTTP address, ``host:port``, or ``None``. When set,
            shared-memory requests go over HTTP: they carry only where each
            tensor lies (a few hundred bytes of JSON), which costs the client
            far less CPU than a gRPC call through ``tritonclient`` (about 1.8x
            the request rate at 4 KB in ``make bench``). Plain-gRPC requests
            and control calls (registration, model config) stay on ``url``.
            ``TritonServer.http_url`` and the node actor provide it.
        default_pool: Pool settings for models not named in ``pools``.
        pools: Pool settings by model name.
        request_timeout_s: Deadline of one inference call; ``None`` waits forever.
        max_parallel_chunks: Threads used to run the pieces of a split batch.
        server_visible_devices: The server's ``CUDA_VISIBLE_DEVICES``, to name
            GPUs of CUDA pools in its numbering: ``"all"`` means the server's
            is unset; ``None`` reads it from the server process (found by its
            port in ``/proc``), and CUDA pools fail with ``DeviceMappingError``
            when that is not possible (a server in another container, of
            another user): then set it. See docs/cuda.md.
        shm_api_key: The key of a server whose shared-memory endpoints are
            protected (``TritonServer.shm_api_key``); sent when registering.
        grpc_fallback: When an output does not fit its slot (a variable-size
            output larger than ``max_shapes`` allows, or a BYTES output larger
            than its region), ``infer`` retries the request over plain gRPC
            instead of raising ``OutputTooLargeError``. The reason is logged
            once per model. (A BYTES input element longer than
            ``PoolConfig.max_element_bytes`` goes over plain gRPC whatever
            this says: that is known before anything is sent.)
        copy_threads: Threads that copy one large tensor (4 MB and more per
            thread) into or out of a system-memory slot; ``None`` uses the
            usable cores, at most 4; 1 copies on the calling thread only.
    """

    url: str = env_field("URL", "127.0.0.1:8001")
    http_url: str | None = env_field("HTTP_URL", None, parse_optional_str)
    default_pool: PoolConfig = field(default_factory=PoolConfig)
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)
    request_timeout_s: float | None = env_field("REQUEST_TIMEOUT_S", 60.0, lambda s: float(s) if s else None)
    max_parallel_chunks: int = env_field("MAX_PARALLEL_CHUNKS", 8)
    server_visible_devices: str | None = env_field("SERVER_VISIBLE_DEVICES", None, parse_optional_str)
    shm_api_key: str | None = env_field("SHM_API_KEY", None, parse_optional_str)
    grpc_fallback: bool = env_field("GRPC_FALLBACK", False)
    copy_threads: int | None = env_field("COPY_THREADS", None, lambda s: int(s) if s.strip() else None)

    def __post_init__(self) -> None:
        if self.copy_threads is not None:
            require_type(self, "copy_threads", int)
            require(self.copy_threads >= 1, "ClientConfig.copy_threads must be >= 1")
        if self.server_visible_devices is not None:
            require_type(self, "server_visible_devices", str)
        require(":" in self.url, f"ClientConfig.url must be host:port, got {self.url!r}")
        if self.http_url is not None:
            require_type(self, "http_url", str)
            host, _, port = self.http_url.rpartition(":")
            require(
                bool(host) and port.isdigit() and "/" not in self.http_url,
                f"ClientConfig.http_url must be host:port (no scheme), got {self.http_url!r}",
            )
        if self.request_timeout_s is not None:
            require(self.request_timeout_s > 0, "ClientConfig.request_timeout_s must be > 0")
        require(self.max_parallel_chunks >= 1, "ClientConfig.max_parallel_chunks must be >= 1")
        for name, pool in dict(self.pools).items():
            require(
                isinstance(pool, PoolConfig),
                f"ClientConfig.pools[{name!r}] must be a PoolConfig, got {type(pool).__name__}",
            )
        object.__setattr__(self, "pools", dict(self.pools))

    def pool_for(self, model: str) -> PoolConfig:
        """The pool settings of ``model``.

        Args:
            model: Model name.

        Returns:
            ``pools[model]`` if given, else ``default_pool``.
        """
        return self.pools.get(model, self.default_pool)
