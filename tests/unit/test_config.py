from __future__ import annotations

import dataclasses
import os
import pickle

import pytest

from ray_triton_shm.config import ClientConfig, PoolConfig, ServerConfig
from ray_triton_shm.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no RAY_TRITON_SHM_* variables unless they set them."""
    for name in list(os.environ):
        if name.startswith("RAY_TRITON_SHM_"):
            monkeypatch.delenv(name)


# -- defaults ----------------------------------------------------------------


def test_server_defaults() -> None:
    config = ServerConfig(model_repository="/models")
    assert config.model_repository == "/models"
    assert config.host == "127.0.0.1"
    assert (config.http_port, config.grpc_port, config.metrics_port) == (0, 0, 0)
    assert config.binary is None
    assert config.python_env is None
    assert config.strict_readiness is True
    assert config.log_verbose == 0
    assert config.exit_timeout_s == 5
    assert config.python_shm_default_bytes == 16 * 1024 * 1024
    assert config.python_shm_growth_bytes == 64 * 1024 * 1024
    assert config.malloc_mmap_threshold_bytes == 256 * 1024 * 1024
    assert config.load_models == ()
    assert config.gpus is None
    assert config.startup_timeout_s == 120.0
    assert config.stop_timeout_s == 10.0
    assert config.log_tail_lines == 200
    assert config.extra_args == ()
    assert config.cache_dir == os.path.join(os.path.expanduser("~"), ".cache", "ray-triton-shm")


def test_pool_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_TRITON_SHM_MIN_SHM_BYTES", raising=False)  # tests/conftest.py sets it
    config = PoolConfig()
    assert config.slots == 4
    assert config.max_batch_size is None
    assert config.max_shapes == {}
    assert config.lease_timeout_s == 30.0
    assert config.min_shm_bytes is None
    assert config.shm_threshold(over_http=True) == 0
    assert config.shm_threshold(over_http=False) == 64 * 1024
    assert PoolConfig(min_shm_bytes=100).shm_threshold(over_http=True) == 100


def test_client_defaults() -> None:
    config = ClientConfig()
    assert config.url == "127.0.0.1:8001"
    assert config.default_pool == PoolConfig()
    assert config.pools == {}
    assert config.request_timeout_s == 60.0
    assert config.max_parallel_chunks == 8


def test_model_repository_is_required() -> None:
    with pytest.raises(ConfigError, match="model_repository"):
        ServerConfig()


# -- explicit > environment > default ---------------------------------------


def test_env_overrides_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_MODEL_REPOSITORY", "/env/models")
    monkeypatch.setenv("RAY_TRITON_SHM_HOST", "127.0.0.2")
    monkeypatch.setenv("RAY_TRITON_SHM_GRPC_PORT", "9001")
    monkeypatch.setenv("RAY_TRITON_SHM_STRICT_READINESS", "off")
    monkeypatch.setenv("RAY_TRITON_SHM_STARTUP_TIMEOUT_S", "2.5")
    monkeypatch.setenv("RAY_TRITON_SHM_LOAD_MODELS", "identity, add_sub,")
    monkeypatch.setenv("RAY_TRITON_SHM_GPUS", "0,2")
    monkeypatch.setenv("RAY_TRITON_SHM_TRITONSERVER", "/opt/tritonserver/bin/tritonserver")
    config = ServerConfig()
    assert config.model_repository == "/env/models"
    assert config.host == "127.0.0.2"
    assert config.grpc_port == 9001
    assert config.strict_readiness is False
    assert config.startup_timeout_s == 2.5
    assert config.load_models == ("identity", "add_sub")
    assert config.gpus == (0, 2)
    assert config.binary == "/opt/tritonserver/bin/tritonserver"


def test_empty_env_for_optional_str_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_TRITONSERVER", "")
    assert ServerConfig(model_repository="m").binary is None


def test_explicit_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_MODEL_REPOSITORY", "/env/models")
    monkeypatch.setenv("RAY_TRITON_SHM_GRPC_PORT", "9001")
    monkeypatch.setenv("RAY_TRITON_SHM_STRICT_READINESS", "false")
    config = ServerConfig(model_repository="/explicit", grpc_port=7001, strict_readiness=True)
    assert config.model_repository == "/explicit"
    assert config.grpc_port == 7001
    assert config.strict_readiness is True


def test_pool_env_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_SLOTS", "7")
    monkeypatch.setenv("RAY_TRITON_SHM_LEASE_TIMEOUT_S", "1.5")
    monkeypatch.setenv("RAY_TRITON_SHM_MIN_SHM_BYTES", "1024")
    from_env = PoolConfig()
    assert (from_env.slots, from_env.lease_timeout_s, from_env.min_shm_bytes) == (7, 1.5, 1024)
    explicit = PoolConfig(slots=2, lease_timeout_s=3.0, min_shm_bytes=0)
    assert (explicit.slots, explicit.lease_timeout_s, explicit.min_shm_bytes) == (2, 3.0, 0)


def test_env_is_read_when_the_object_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PoolConfig().slots == 4
    monkeypatch.setenv("RAY_TRITON_SHM_SLOTS", "9")
    assert PoolConfig().slots == 9


def test_client_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_URL", "localhost:9999")
    monkeypatch.setenv("RAY_TRITON_SHM_REQUEST_TIMEOUT_S", "")
    monkeypatch.setenv("RAY_TRITON_SHM_MAX_PARALLEL_CHUNKS", "3")
    monkeypatch.setenv("RAY_TRITON_SHM_SLOTS", "5")
    monkeypatch.setenv("RAY_TRITON_SHM_COPY_THREADS", "2")
    config = ClientConfig()
    assert config.copy_threads == 2
    assert ClientConfig(copy_threads=1).copy_threads == 1
    monkeypatch.setenv("RAY_TRITON_SHM_COPY_THREADS", "")
    assert ClientConfig().copy_threads is None
    assert config.url == "localhost:9999"
    assert config.request_timeout_s is None
    assert config.max_parallel_chunks == 3
    assert config.default_pool.slots == 5
    assert ClientConfig(url="h:1", request_timeout_s=2.0).request_timeout_s == 2.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
    ],
)
def test_bool_env_spellings(monkeypatch: pytest.MonkeyPatch, text: str, expected: bool) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_STRICT_READINESS", text)
    assert ServerConfig(model_repository="m").strict_readiness is expected


@pytest.mark.parametrize(
    ("var", "text", "build"),
    [
        ("RAY_TRITON_SHM_SLOTS", "four", PoolConfig),
        ("RAY_TRITON_SHM_SLOTS", "2.5", PoolConfig),
        ("RAY_TRITON_SHM_LEASE_TIMEOUT_S", "soon", PoolConfig),
        ("RAY_TRITON_SHM_STRICT_READINESS", "maybe", lambda: ServerConfig(model_repository="m")),
        ("RAY_TRITON_SHM_GRPC_PORT", "", lambda: ServerConfig(model_repository="m")),
        ("RAY_TRITON_SHM_GPUS", "0,x", lambda: ServerConfig(model_repository="m")),
        ("RAY_TRITON_SHM_REQUEST_TIMEOUT_S", "never", ClientConfig),
        ("RAY_TRITON_SHM_MAX_PARALLEL_CHUNKS", "many", ClientConfig),
    ],
)
def test_bad_env_text_raises_config_error(
    monkeypatch: pytest.MonkeyPatch, var: str, text: str, build
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError, match=var):
        build()


@pytest.mark.parametrize(
    ("var", "text", "build"),
    [
        ("RAY_TRITON_SHM_SLOTS", "0", PoolConfig),
        ("RAY_TRITON_SHM_HTTP_PORT", "70000", lambda: ServerConfig(model_repository="m")),
        ("RAY_TRITON_SHM_STARTUP_TIMEOUT_S", "-1", lambda: ServerConfig(model_repository="m")),
        ("RAY_TRITON_SHM_URL", "no-port", ClientConfig),
    ],
)
def test_out_of_range_env_raises_config_error(
    monkeypatch: pytest.MonkeyPatch, var: str, text: str, build
) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError):
        build()


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_repository": ""},
        {"http_port": -1},
        {"grpc_port": 65536},
        {"metrics_port": 100000},
        {"log_verbose": -1},
        {"exit_timeout_s": -1},
        {"startup_timeout_s": 0},
        {"stop_timeout_s": -0.5},
        {"log_tail_lines": 0},
        {"python_shm_default_bytes": 0},
        {"python_shm_growth_bytes": -1},
        {"malloc_mmap_threshold_bytes": -1},
        {"malloc_mmap_threshold_bytes": 1 << 41},
        {"malloc_mmap_threshold_bytes": 1.5e6},
        {"malloc_mmap_threshold_bytes": True},
        {"host": ""},
        {"gpus": (0, -1)},
    ],
)
def test_invalid_server_config(kwargs: dict) -> None:
    kwargs = {"model_repository": "m", **kwargs}
    with pytest.raises(ConfigError):
        ServerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slots": 0},
        {"slots": -3},
        {"max_batch_size": 0},
        {"lease_timeout_s": 0},
        {"min_shm_bytes": -1},
        {"max_shapes": {"X": (0,)}},
        {"max_shapes": {"X": (4, -1)}},
    ],
)
def test_invalid_pool_config(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        PoolConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"url": "localhost"},
        {"request_timeout_s": 0},
        {"max_parallel_chunks": 0},
        {"copy_threads": 0},
        {"copy_threads": 2.0},
        {"copy_threads": True},
        {"pools": {"identity": {"slots": 2}}},
    ],
)
def test_invalid_client_config(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        ClientConfig(**kwargs)


def test_config_error_is_raised_even_under_python_O() -> None:
    """Validation must not rely on ``assert`` (which ``python -O`` strips)."""
    import subprocess
    import sys

    code = (
        "from ray_triton_shm.config import PoolConfig\n"
        "from ray_triton_shm.errors import ConfigError\n"
        "try:\n"
        "    PoolConfig(slots=0)\n"
        "except ConfigError:\n"
        "    print('refused')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TRITON_SHM_")}
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "refused"


# -- frozen, pickle ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ServerConfig(model_repository="m"), "host"),
        (PoolConfig, "slots"),
        (ClientConfig, "url"),
    ],
)
def test_frozen(build, field: str) -> None:
    config = build()
    before = getattr(config, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, "x")
    assert getattr(config, field) == before


def test_pickle_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ServerConfig(
        model_repository="/models",
        grpc_port=8123,
        load_models=["a", "b"],
        gpus=(1,),
        extra_args=["--log-info=true"],
        strict_readiness=False,
    )
    pool = PoolConfig(slots=3, max_batch_size=2, max_shapes={"X": [5, 6]})
    client = ClientConfig(
        url="h:1", pools={"m": pool}, default_pool=PoolConfig(slots=1), request_timeout_s=None
    )
    payload = pickle.dumps((server, pool, client))
    # The environment at load time must not leak into unpickled objects.
    monkeypatch.setenv("RAY_TRITON_SHM_SLOTS", "11")
    monkeypatch.setenv("RAY_TRITON_SHM_HOST", "10.0.0.1")
    server2, pool2, client2 = pickle.loads(payload)
    assert server2 == server and pool2 == pool and client2 == client
    assert server2.host == "127.0.0.1"
    assert pool2.max_shapes == {"X": (5, 6)}
    assert client2.pool_for("m").slots == 3
    assert client2.pool_for("other").slots == 1
    assert client2.request_timeout_s is None


# -- server environment -------------------------------------------------------------


def test_glibc_tunables_set_both_malloc_thresholds() -> None:
    config = ServerConfig(model_repository="m", malloc_mmap_threshold_bytes=1000)
    assert config.glibc_tunables() == "glibc.malloc.mmap_threshold=1000:glibc.malloc.trim_threshold=2000"


def test_glibc_tunables_keep_what_the_environment_sets() -> None:
    config = ServerConfig(model_repository="m", malloc_mmap_threshold_bytes=1000)
    inherited = "glibc.malloc.trim_threshold=7:glibc.cpu.hwcaps=-AVX512F"
    assert config.glibc_tunables(inherited) == (
        "glibc.malloc.trim_threshold=7:glibc.cpu.hwcaps=-AVX512F:glibc.malloc.mmap_threshold=1000"
    )
    both = "glibc.malloc.mmap_threshold=5:glibc.malloc.trim_threshold=6"
    assert config.glibc_tunables(both) == both


def test_glibc_tunables_untouched_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_TRITON_SHM_MALLOC_MMAP_THRESHOLD_BYTES", "0")
    config = ServerConfig(model_repository="m")
    assert config.malloc_mmap_threshold_bytes == 0
    assert config.glibc_tunables() == ""
    assert config.glibc_tunables("glibc.cpu.hwcaps=-AVX2") == "glibc.cpu.hwcaps=-AVX2"


def test_malloc_threshold_is_no_server_flag() -> None:
    flags = ServerConfig(model_repository="m", malloc_mmap_threshold_bytes=12345).server_flags()
    assert not any("12345" in flag for flag in flags)


# -- server flags ------------------------------------------------------------------


def test_server_flags_defaults() -> None:
    flags = ServerConfig(model_repository="/models").server_flags()
    assert flags == [
        "--model-repository=/models",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        "--http-port=0",
        "--grpc-port=0",
        "--metrics-port=0",
        "--log-verbose=0",
        "--exit-timeout-secs=5",
        "--strict-readiness=true",
        "--backend-config=python,shm-default-byte-size=16777216",
        "--backend-config=python,shm-growth-byte-size=67108864",
    ]


def test_server_flags_follow_fields() -> None:
    config = ServerConfig(
        model_repository="/m",
        host="::1",
        http_port=8000,
        grpc_port=8001,
        metrics_port=8002,
        strict_readiness=False,
        log_verbose=2,
        python_shm_growth_bytes=1024,
        load_models=("identity", "add_sub"),
        extra_args=("--log-info=true", "--disable-auto-complete-config"),
        # Fields without a flag must not leak into the command line.
        binary="/bin/tritonserver",
        gpus=(0,),
        startup_timeout_s=3,
    )
    flags = config.server_flags()
    for name in ("http", "grpc", "metrics"):
        assert f"--{name}-address=::1" in flags
    assert "--http-port=8000" in flags and "--grpc-port=8001" in flags and "--metrics-port=8002" in flags
    assert "--strict-readiness=false" in flags
    assert "--strict-readiness=False" not in flags
    assert "--log-verbose=2" in flags
    assert "--backend-config=python,shm-growth-byte-size=1024" in flags
    explicit = flags.index("--model-control-mode=explicit")
    assert flags[explicit + 1 : explicit + 3] == ["--load-model=identity", "--load-model=add_sub"]
    assert flags[-2:] == ["--log-info=true", "--disable-auto-complete-config"]
    assert not any("tritonserver" in f or "gpus" in f or "startup" in f for f in flags)


def test_server_flags_without_load_models_has_no_explicit_mode() -> None:
    flags = ServerConfig(model_repository="/m").server_flags()
    assert not any(f.startswith("--model-control-mode") or f.startswith("--load-model") for f in flags)


def test_sequences_are_normalised_to_tuples() -> None:
    config = ServerConfig(model_repository="m", load_models=["a"], extra_args=["--x"])
    assert config.load_models == ("a",)
    assert config.extra_args == ("--x",)


# -- pool / client ---------------------------------------------------------------


def test_max_shapes_normalised() -> None:
    source = {"INPUT0": [1024], "IMAGE": (3, "224", 224.0)}
    config = PoolConfig(max_shapes=source)
    assert config.max_shapes == {"INPUT0": (1024,), "IMAGE": (3, 224, 224)}
    assert all(type(d) is int for shape in config.max_shapes.values() for d in shape)
    # A copy: changing the caller's dict afterwards does not change the config.
    source["INPUT0"] = [1]
    assert config.max_shapes["INPUT0"] == (1024,)


def test_pool_for() -> None:
    special = PoolConfig(slots=2)
    default = PoolConfig(slots=6)
    config = ClientConfig(default_pool=default, pools={"identity": special})
    assert config.pool_for("identity") is special
    assert config.pool_for("add_sub") is default
    assert ClientConfig().pool_for("anything") == PoolConfig()


def test_node_config_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_triton_shm.node import NodeConfig

    server = ServerConfig(model_repository="/models")
    defaults = NodeConfig(server=server)
    assert (defaults.idle_shutdown_s, defaults.request_timeout_s, defaults.preload) == (30.0, 60.0, ())
    monkeypatch.setenv("RAY_TRITON_SHM_IDLE_SHUTDOWN_S", "none")
    monkeypatch.setenv("RAY_TRITON_SHM_REQUEST_TIMEOUT_S", "7.5")
    monkeypatch.setenv("RAY_TRITON_SHM_PRELOAD", "add_sub, identity")
    monkeypatch.setenv("RAY_TRITON_SHM_HEALTH_INTERVAL_S", "2")
    monkeypatch.setenv("RAY_TRITON_SHM_QUARANTINE_S", "3")
    from_env = NodeConfig(server=server)
    assert from_env.idle_shutdown_s is None and from_env.request_timeout_s == 7.5
    assert from_env.preload == ("add_sub", "identity")
    assert (from_env.health_interval_s, from_env.quarantine_s) == (2.0, 3.0)
    explicit = NodeConfig(server=server, idle_shutdown_s=5.0, preload=("x",))
    assert (explicit.idle_shutdown_s, explicit.preload) == (5.0, ("x",))
    monkeypatch.setenv("RAY_TRITON_SHM_IDLE_SHUTDOWN_S", "soon")
    with pytest.raises(ConfigError, match="RAY_TRITON_SHM_IDLE_SHUTDOWN_S"):
        NodeConfig(server=server)


@pytest.mark.parametrize(
    "fields",
    [
        {"idle_shutdown_s": -1.0},
        {"request_timeout_s": 0},
        {"health_interval_s": True},
        {"preload": "add_sub"},
        {"pools": {"m": {"slots": 2}}},
    ],
)
def test_node_config_refuses_bad_settings(fields: dict) -> None:
    from ray_triton_shm.node import NodeConfig

    with pytest.raises(ConfigError):
        NodeConfig(server=ServerConfig(model_repository="/models"), **fields)


def test_node_config_fingerprint_follows_what_triton_runs() -> None:
    from ray_triton_shm.node import NodeConfig

    def config(repository: str = "/a", **kwargs) -> NodeConfig:
        return NodeConfig(server=ServerConfig(model_repository=repository), **kwargs)

    base = config(pools={"m": PoolConfig(slots=2), "n": PoolConfig(slots=3)})
    same = config(pools={"n": PoolConfig(slots=3), "m": PoolConfig(slots=2)})
    assert base.fingerprint() == same.fingerprint() == pickle.loads(pickle.dumps(base)).fingerprint()
    assert config(pools=base.pools, request_timeout_s=5.0).fingerprint() == base.fingerprint()
    client_side = {"m": PoolConfig(slots=2, lease_timeout_s=3.0, min_shm_bytes=0), "n": PoolConfig(slots=3)}
    assert config(pools=client_side).fingerprint() == base.fingerprint()
    for other in (
        config("/b", pools=base.pools),
        config(pools={"m": PoolConfig(slots=4), "n": PoolConfig(slots=3)}),
        # Another BYTES bound is another slot layout: another node actor and pools.
        config(pools={"m": PoolConfig(slots=2, max_element_bytes=1024), "n": PoolConfig(slots=3)}),
        config(pools=base.pools, idle_shutdown_s=None),
    ):
        assert other.fingerprint() != base.fingerprint()


def test_serve_args_reach_every_node_setting(tmp_path) -> None:
    from ray_triton_shm.serve import build_node_config

    config = build_node_config(
        str(tmp_path),
        pools={"m": {"slots": 2, "lease_timeout_s": 4.0}},
        idle_shutdown_s=None,
        health_interval_s=1.5,
        preload=["m"],
        request_timeout_s=9.0,
        quarantine_s=2.0,
    )
    assert config.idle_shutdown_s is None and config.health_interval_s == 1.5
    assert config.preload == ("m",) and config.request_timeout_s == 9.0 and config.quarantine_s == 2.0
    assert config.pool_for("m").lease_timeout_s == 4.0
    with pytest.raises(ConfigError, match="unknown node settings"):
        build_node_config(str(tmp_path), idle_timeout=3)
