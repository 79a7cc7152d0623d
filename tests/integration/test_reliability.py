"""Faults and bad input against a real Triton (docs/reliability.md cases 1-7, 9-11, security defaults).

Each test asserts a typed error or continued service, that every slot is back
in its pool, and that nothing is left in /dev/shm (the ``client`` fixtures and
tests/conftest.py check the last two for every test).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ray_triton_shm import (
    InputError,
    OutputTooLargeError,
    PoolConfig,
    ServerConfig,
    ServerStartError,
    SharedMemoryError,
    TritonCallError,
    TritonServer,
    TritonShmClient,
)
from ray_triton_shm._private.core.local_pools import fetch_layout
from ray_triton_shm._private.shm import segment, sweep
from ray_triton_shm._private.shm.pool import SlotPool
from ray_triton_shm._private.triton.call_errors import translate_error
from ray_triton_shm._private.triton.server_env import default_env_dir, embedded_plan
from ray_triton_shm._private.triton.server_launch import SHM_API_GRPC_HEADER, SHM_API_HEADER

from .conftest import MODEL_REPOSITORY, close_and_check, transport_overrides
from .footprint import assert_flat, process_footprint

# -- helpers -----------------------------------------------------------------


def _free_slots(client: TritonShmClient, model: str) -> int:
    stats = client.pool(model).stats()
    assert stats.busy == 0, stats
    return stats.free


def _regions(url: str) -> set[str]:
    with grpcclient.InferenceServerClient(url) as raw:
        status = raw.get_system_shared_memory_status(as_json=True)
    return set(status.get("regions", {}))


def _add_sub(client: TritonShmClient, value: int) -> None:
    a = np.full((2, 16), value, np.int32)
    b = np.arange(32, dtype=np.int32).reshape(2, 16)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


@pytest.fixture(scope="module")
def own_server() -> Iterator[TritonServer]:
    """A second server of this module's own (restarted by some tests; the session one is not)."""
    server = TritonServer(
        ServerConfig(model_repository=str(MODEL_REPOSITORY), load_models=("add_sub", "identity", "sleep"))
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- case 1: a server that needs --allow-client-shm ------------------------------


def _wrapper(tmp_path: Path, *, advertise: bool) -> tuple[ServerConfig, Path]:
    """A tritonserver wrapper that refuses to start unless given --allow-client-shm=true.

    It stands for Triton 2.69+, where client shared memory is off by default; the
    flag is stripped before the real 2.51 binary is exec'd, so the server serves.
    """
    env_dir = default_env_dir(ServerConfig(model_repository=str(tmp_path)).cache_dir)
    plan = embedded_plan(env_dir)
    if plan is None:
        pytest.skip("the embedded server is not provisioned")
    marker = tmp_path / "saw-allow-client-shm"
    help_extra = 'echo "  --allow-client-shm <boolean>"' if advertise else "true"
    script = tmp_path / "tritonserver"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            export LD_LIBRARY_PATH={":".join(plan.library_paths)}
            if [ "$1" = "--help" ]; then {plan.binary} --help; {help_extra}; exit 0; fi
            args=(); seen=0
            for a in "$@"; do
              if [ "$a" = "--allow-client-shm=true" ]; then seen=1; else args+=("$a"); fi
            done
            if [ $seen = 0 ]; then
              echo "error: client shared memory is disabled; start with --allow-client-shm=true" >&2
              exit 3
            fi
            touch {marker}
            exec {plan.binary} "${{args[@]}}" {" ".join(plan.extra_flags)}
            """
        )
    )
    script.chmod(0o755)
    config = ServerConfig(
        model_repository=str(MODEL_REPOSITORY),
        binary=str(script),
        python_env=str(env_dir),
        load_models=("add_sub",),
    )
    return config, marker


def test_server_that_requires_allow_client_shm_gets_the_flag(tmp_path: Path) -> None:
    config, marker = _wrapper(tmp_path, advertise=True)
    with TritonServer(config) as server, TritonShmClient(url=server.grpc_url) as client:
        assert marker.exists(), "the wrapper never saw --allow-client-shm=true"
        _add_sub(client, 3)
        assert client.pool_stats()[0].free == client.pool_stats()[0].slots


def test_server_refusing_client_shm_fails_clearly_at_startup(tmp_path: Path) -> None:
    config, marker = _wrapper(tmp_path, advertise=False)  # needs the flag but hides it: we cannot know
    server = TritonServer(config)
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert "--allow-client-shm" in info.value.log_tail
    assert not server.is_alive() and not marker.exists()


# -- case 2: region registration and request spans ------------------------------


@pytest.mark.parametrize(
    ("size", "offset", "nbytes"),
    [
        (4096, 4096, 1),  # starts at the end
        (4096, 5000, 16),  # starts past the end
        (4096, 0, 4097),  # one byte too long
        (4096, 4000, 100),  # runs over the end
        (4096, -1, 16),  # negative offset
        (4096, 0, -1),  # negative size
        (4096, 2**64 - 1, 16),  # uint64 max
        (4096, 2**63 - 16, 32),  # the sum overflows int64
        (0, 0, 0),  # empty region
        (4096, 0, 2.5),  # not an int
    ],
)
def test_out_of_range_spans_are_refused_locally(size: int, offset: int, nbytes: int) -> None:
    with pytest.raises(SharedMemoryError):
        segment.check_span("r", size, offset, nbytes)


def test_triton_refuses_bad_registrations_too_and_the_key_is_redacted(triton_server: TritonServer) -> None:
    """What the server does with what we refuse locally; our translation hides the segment key."""
    seg = segment.Segment.create(segment.new_segment_name("test"), 4096)
    name = segment.new_segment_name("region")
    try:
        with grpcclient.InferenceServerClient(triton_server.grpc_url) as raw:
            for offset, size in ((5000, 16), (0, 8192), (0, 0), (4000, 200)):
                with pytest.raises(InferenceServerException) as info:
                    raw.register_system_shared_memory(name, seg.key, size, offset=offset)
                assert "rtshm_" in info.value.message()  # Triton names the key or region ...
                ours = translate_error(info.value)
                assert seg.name not in str(ours) and "rtshm_" not in str(ours)  # ... we do not
            raw.register_system_shared_memory(name, seg.key, 4096)
            try:
                with pytest.raises(InferenceServerException) as info:
                    raw.register_system_shared_memory(name, seg.key, 4096)
                err = translate_error(info.value)
                assert isinstance(err, TritonCallError) and err.status == "ALREADY_EXISTS"
            finally:
                raw.unregister_system_shared_memory(name)
    finally:
        seg.close()


@pytest.mark.parametrize("elements", [4096, 2**40, 2**62])
def test_request_past_the_slot_is_refused_before_the_server(client: TritonShmClient, elements: int) -> None:
    """A lease whose recorded shape outgrows the slot (even to int64 overflow) never reaches Triton."""
    with client.lease("add_sub") as lease:
        lease.input("INPUT0", (1, 16))[:] = 1
        lease.input("INPUT1", (1, 16))[:] = 2
        lease.input_shapes["INPUT0"] = (elements, 16)  # what a buggy caller could leave behind
        with pytest.raises((InputError, SharedMemoryError)):
            client.run(lease)
    assert _free_slots(client, "add_sub") == client.pool("add_sub").stats().slots
    _add_sub(client, 1)  # the pool is still good


# -- case 3: byte sizes and outputs larger than their slot ------------------------


def test_input_byte_size_mismatch_is_refused_by_triton_with_a_clear_message(client: TritonShmClient) -> None:
    """Our own check refuses it earlier (test_client's bad-input cases); this is Triton's answer."""
    pool = client.pool("add_sub")
    spec = pool.layout.input("INPUT0")
    with grpcclient.InferenceServerClient(client.config.url) as raw:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = grpcclient.InferInput(name, [1, 16], "INT32")
            tensor.set_shared_memory(pool.region_name, 60, offset=spec.offset)  # 64 expected
            inputs.append(tensor)
        with pytest.raises(InferenceServerException) as info:
            raw.infer("add_sub", inputs)
    err = translate_error(info.value, "add_sub")
    assert err.status == "INVALID_ARGUMENT" and "Expected 64, got 60" in str(err)


def _small_output_pools() -> dict[str, PoolConfig]:
    return {
        "identity": PoolConfig(slots=2, max_batch_size=1, max_shapes={"INPUT0": (1024,), "OUTPUT0": (16,)})
    }


def test_output_larger_than_its_slot_raises_and_never_truncates(make_client) -> None:
    client = make_client(pools=_small_output_pools())
    x = np.arange(100, dtype=np.float32).reshape(1, 100)
    with pytest.raises(OutputTooLargeError, match="should be at least 400 bytes") as info:
        client.infer("identity", {"INPUT0": x})
    assert "max_shapes" in str(info.value) and "rtshm_" not in str(info.value)
    assert _free_slots(client, "identity") == 2
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    np.testing.assert_array_equal(client.infer("identity", {"INPUT0": small})["OUTPUT0"], small)


def test_output_larger_than_its_slot_falls_back_to_grpc_when_asked(make_client) -> None:
    client = make_client(pools=_small_output_pools(), grpc_fallback=True)
    x = np.arange(100, dtype=np.float32).reshape(1, 100)
    out = client.infer("identity", {"INPUT0": x})
    assert out.path == "grpc"
    np.testing.assert_array_equal(out["OUTPUT0"], x)
    assert _free_slots(client, "identity") == 2


# -- case 4: the server forgot our region ---------------------------------------


def test_region_lost_in_a_triton_restart_is_registered_again(
    own_server: TritonServer, shm_transport: str
) -> None:
    with TritonShmClient(**transport_overrides(own_server, shm_transport)) as client:
        _add_sub(client, 1)
        region = client.pool("add_sub").region_name
        own_server.restart()
        assert region not in _regions(own_server.grpc_url)
        _add_sub(client, 2)
        assert region in _regions(own_server.grpc_url)
        assert _free_slots(client, "add_sub") == client.pool("add_sub").stats().slots
    assert region not in _regions(own_server.grpc_url)


class _NoReregister:
    """A pool source that cannot register again (as a node actor's grant): the error must surface."""

    def __init__(self, url: str) -> None:
        self.raw = grpcclient.InferenceServerClient(url)
        self.pools: list[SlotPool] = []

    def get_pool(self, model: str, config: PoolConfig) -> SlotPool:
        pool = SlotPool.create(fetch_layout(self.raw, model, config), config.slots)
        self.raw.register_system_shared_memory(pool.region_name, pool.segment.key, pool.segment.size)
        self.pools.append(pool)
        return pool

    def close(self) -> None:
        for pool in self.pools:
            try:
                self.raw.unregister_system_shared_memory(pool.region_name)
            except InferenceServerException:
                pass
            pool.close()
        self.raw.close()


def test_region_unknown_and_not_recoverable_is_reported_once(
    own_server: TritonServer, shm_transport: str
) -> None:
    source = _NoReregister(own_server.grpc_url)
    client = TritonShmClient(**transport_overrides(own_server, shm_transport), pool_source=source)
    try:
        _add_sub(client, 1)
        # Triton refuses while the request just answered still holds the region (it lets go of
        # it a moment after the answer, later on a loaded machine): again until it has.
        deadline = time.monotonic() + 30
        while True:
            try:
                source.raw.unregister_system_shared_memory(client.pool("add_sub").region_name)
                break
            except InferenceServerException as e:
                if "in use" not in str(e.message()) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(TritonCallError) as info:
            _add_sub(client, 2)
        assert time.monotonic() - started < 5, "an unknown region must not be retried"
        assert info.value.status == "NOT_FOUND"
        assert "rtshm_" not in str(info.value)
        assert _free_slots(client, "add_sub") == client.pool("add_sub").stats().slots
    finally:
        close_and_check(client)


# -- case 6: users, pools and servers side by side ------------------------------------


def test_segments_are_private_to_their_user(client: TritonShmClient) -> None:
    pool = client.pool("add_sub")
    path = os.path.join(segment.SHM_DIR, pool.segment.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    code = textwrap.dedent(
        f"""
        import os, sys
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        for flags in (os.O_RDONLY, os.O_RDWR):
            try:
                os.open({path!r}, flags)
            except PermissionError:
                continue
            sys.exit("opened the segment as another user")
        print("refused")
        """
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr
    _add_sub(client, 4)


def test_two_servers_and_two_pools_on_one_node_do_not_collide(
    triton_server: TritonServer, own_server: TritonServer
) -> None:
    clients = [TritonShmClient(url=s.grpc_url) for s in (triton_server, own_server, own_server)]
    errors: list[BaseException] = []

    def work(client: TritonShmClient, base: int) -> None:
        try:
            for i in range(40):
                _add_sub(client, base + i)
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=work, args=(c, 1000 * k)) for k, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        names = [c.pool("add_sub").region_name for c in clients]
        assert len(set(names)) == 3
        assert names[0] not in _regions(own_server.grpc_url)
        assert set(names[1:]) <= _regions(own_server.grpc_url)
    finally:
        for c in clients:
            close_and_check(c)


# -- case 7: unregistering while requests are in flight ------------------------------


def test_unregister_while_requests_are_in_flight(own_server: TritonServer, shm_transport: str) -> None:
    results: dict[int, object] = {}
    pools = {"sleep": PoolConfig(slots=4)}
    with TritonShmClient(**transport_overrides(own_server, shm_transport), pools=pools) as client:
        client.infer("sleep", {"INPUT0": np.zeros((1, 1), np.float32)})
        region = client.pool("sleep").region_name

        def call(i: int) -> None:
            x = np.full((1, 1), 1.5 + i / 1000, np.float32)
            try:
                results[i] = client.infer("sleep", {"INPUT0": x})["OUTPUT0"]
            except Exception as e:
                results[i] = e

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # All four hold their slot: their requests are sent within moments and run 1.5 s each.
        deadline = time.monotonic() + 30
        while client.pool("sleep").stats().busy < 4:
            assert time.monotonic() < deadline, "the four requests never all held a slot"
            time.sleep(0.005)
        # A slot is leased just before its request is sent: give the requests time to reach Triton
        # (they then hold the region for 1.5 s at least), even on a loaded machine.
        time.sleep(0.5)
        with grpcclient.InferenceServerClient(own_server.grpc_url) as raw:
            # Triton 2.51 refuses while the region is in use, and the requests go on.
            with pytest.raises(InferenceServerException, match="in use"):
                raw.unregister_system_shared_memory(region)
            for t in threads:
                t.join()
            # Idle now: it goes. Triton lets go of a request's region just after its answer is
            # sent, so an unregister right after the last answer may still find it in use.
            deadline = time.monotonic() + 10
            while True:
                try:
                    raw.unregister_system_shared_memory(region)
                    break
                except InferenceServerException as e:
                    if "in use" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        assert sorted(results) == [0, 1, 2, 3], "a request was lost"
        for i, result in results.items():
            assert not isinstance(result, Exception), result  # the refused unregister hurt nobody
            np.testing.assert_allclose(result, [[1.5 + i / 1000]], rtol=1e-6)
        # Service continues: the region comes back on the next call.
        out = client.infer("sleep", {"INPUT0": np.full((1, 1), 0.01, np.float32)})
        np.testing.assert_allclose(out["OUTPUT0"], [[0.01]], rtol=1e-6)
        assert region in _regions(own_server.grpc_url)
        assert client.pool("sleep").stats().free == 4


# -- case 9: /dev/shm too small -------------------------------------------------------


def test_pool_larger_than_dev_shm_fails_at_creation(make_client, triton_server: TritonServer) -> None:
    st = os.statvfs(segment.SHM_DIR)
    free = st.f_bavail * st.f_frsize
    elements = free // 4 // 2 + 1024  # input + output of one slot exceed what is free
    client = make_client(
        pools={"identity": PoolConfig(slots=1, max_shapes={"INPUT0": (elements,), "OUTPUT0": (elements,)})}
    )
    before = set(sweep.list_segments())
    with pytest.raises(SharedMemoryError, match="/dev/shm has too little space"):
        client.infer("identity", {"INPUT0": np.zeros((1, 4), np.float32)})
    assert set(sweep.list_segments()) <= before
    assert not [r for r in _regions(triton_server.grpc_url) if r not in before]


# -- case 11: a process that only attached exits ---------------------------------------


def test_attacher_exiting_normally_leaves_the_segment(client: TritonShmClient) -> None:
    """Python < 3.13's resource tracker would unlink it; we never hand segments to it."""
    pool = client.pool("add_sub")
    code = textwrap.dedent(
        f"""
        import multiprocessing.resource_tracker as rt, sys
        from ray_triton_shm._private.shm.segment import Segment
        seg = Segment.attach({pool.segment.name!r})
        seg.mm[:4] = b"ping"
        assert rt._resource_tracker._pid is None, "a resource tracker was started"
        sys.exit(0)   # a normal exit, atexit handlers and all
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert os.path.exists(os.path.join(segment.SHM_DIR, pool.segment.name))
    assert bytes(pool.segment.mm[:4]) == b"ping"
    _add_sub(client, 5)


# -- security defaults --------------------------------------------------------------------


def test_loopback_by_default_and_protection_turns_on_off_loopback() -> None:
    repo = str(MODEL_REPOSITORY)
    assert ServerConfig(model_repository=repo).host == "127.0.0.1"
    assert TritonServer(ServerConfig(model_repository=repo)).shm_api_key is None
    assert TritonServer(ServerConfig(model_repository=repo, host="0.0.0.0")).shm_api_key
    assert (
        TritonServer(ServerConfig(model_repository=repo, host="0.0.0.0", protect_shm_api=False)).shm_api_key
        is None
    )
    flags = ServerConfig(model_repository=repo).server_flags()
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"):
        assert flag in flags


def test_protected_shm_endpoints_need_the_key(caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(
        model_repository=str(MODEL_REPOSITORY), load_models=("add_sub",), protect_shm_api=True
    )
    caplog.set_level("INFO", logger="ray_triton_shm.server")
    with TritonServer(config) as server:
        key = server.shm_api_key
        assert key and len(key) >= 32
        assert key not in caplog.text
        seg = segment.Segment.create(segment.new_segment_name("test"), 4096)
        try:
            with grpcclient.InferenceServerClient(server.grpc_url) as raw:
                with pytest.raises(InferenceServerException):
                    raw.register_system_shared_memory("intruder", seg.key, 4096)
                with pytest.raises(InferenceServerException):
                    raw.get_system_shared_memory_status()
                with pytest.raises(InferenceServerException):
                    raw.register_system_shared_memory(
                        "intruder", seg.key, 4096, headers={SHM_API_GRPC_HEADER: "wrong"}
                    )
            request = urllib.request.Request(
                f"http://{server.http_url}/v2/systemsharedmemory/region/intruder/register",
                data=f'{{"key": "{seg.key}", "offset": 0, "byte_size": 4096}}'.encode(),
                headers={SHM_API_HEADER: "wrong"},
                method="POST",
            )
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(request, timeout=10)
            assert "intruder" not in _regions_with(server)
        finally:
            seg.close()
        with TritonShmClient(url=server.grpc_url) as keyless:
            with pytest.raises(TritonCallError, match="shm_api_key"):
                keyless.infer(
                    "add_sub", {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": np.zeros((1, 16), np.int32)}
                )
        with TritonShmClient(url=server.grpc_url, shm_api_key=key) as keyed:
            _add_sub(keyed, 6)
            assert keyed.pool("add_sub").region_name in _regions_with(server)


def _regions_with(server: TritonServer) -> set[str]:
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        status = raw.get_system_shared_memory_status(headers=server.shm_api_headers, as_json=True)
    return set(status.get("regions", {}))


# -- case 10: many lease/release cycles -----------------------------------------------

# `make test` runs a short variant; `make soak` sets 100000.
LEAK_CYCLES = int(os.environ.get("RAY_TRITON_SHM_LEAK_CYCLES", "4000"))


def test_lease_release_cycles_keep_memory_and_fds_flat(
    triton_server: TritonServer, make_client, record_property
) -> None:
    client = make_client(pools={"add_sub": PoolConfig(slots=2, max_batch_size=1)})
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    assert triton_server.pid is not None

    def cycles(n: int) -> None:
        for i in range(n):
            with client.lease("add_sub") as lease:
                lease.input("INPUT0", (1, 16))[:] = a + i
                lease.input("INPUT1", (1, 16))[:] = a
                out = client.run(lease)
                assert out["OUTPUT0"][0, 0] == 2 * a[0, 0] + i
                del out

    cycles(max(1000, LEAK_CYCLES // 10))  # warm-up: gRPC buffers, allocator arenas
    before = {"client": process_footprint(os.getpid()), "server": process_footprint(triton_server.pid)}
    cycles(LEAK_CYCLES)
    after = {"client": process_footprint(os.getpid()), "server": process_footprint(triton_server.pid)}
    for name in before:
        record_property(f"{name}_before", (before[name].rss_kb, len(before[name].fds)))
        record_property(f"{name}_after", (after[name].rss_kb, len(after[name].fds)))
        assert_flat(f"{name} after {LEAK_CYCLES} cycles", before[name], after[name])
    assert _free_slots(client, "add_sub") == 2


# -- load: the short soak through the direct client ---------------------------------------


def test_short_soak_through_the_client_every_response_matches(triton_server: TritonServer) -> None:
    """The short form of `make soak`: 16 callers on 4 slots, every answer checked against its tag."""
    from ray_triton_shm._private.cli.soak import soak_client

    report = soak_client(duration_s=15, callers=16, slots=4, url=triton_server.grpc_url)
    print(report.summary())
    assert report.requests > 100
    assert report.error_count == 0, report.errors
    assert report.mismatches == 0
