"""Installed the way users install, served the way users serve: ``serve run`` of a Serve config naming
``model_repository: examples``, with the package only from a wheel in a new venv, run from another
directory. One KServe v2 request gets the right answer; SIGTERM leaves nothing of the run behind
(no Triton, no segment, no process of its session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from ..test_wheel import build, install
from .conftest import free_port, frontdoor_on_free_ports

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[3]


def _processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (command line, parent pid, session id) of every process we can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (cmdline, int(fields[1]), int(fields[3]))
    return out


def _http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e).encode()


def _program(cmdline: str) -> str:
    return Path(cmdline.split(" ", 1)[0]).name


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of a run we started in its own session."""
    for pid, (_, _, session) in _processes().items():
        if session == sid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(1.0)


def test_serve_run_of_the_examples_config_from_the_wheel(tmp_path: Path) -> None:
    (tmp_path / "dist").mkdir()
    wheel = build(tmp_path / "dist")[0]
    installed = install(wheel, tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS")}
    setup = subprocess.run(
        [str(installed.cli), "setup"], cwd=installed.elsewhere, env=env, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-2000:]

    # The Serve config shipped in the package, as a user copies it: another port, one replica.
    spec = frontdoor_on_free_ports(
        yaml.safe_load((installed.site / "ray_triton_shm" / "examples" / "triton_shm.yaml").read_text())
    )
    port = free_port()
    spec["http_options"]["port"] = port
    app = spec["applications"][0]
    assert app["args"]["model_repository"] == "examples"
    app["deployments"][0]["num_replicas"] = 1
    config = installed.elsewhere / "serve.yaml"
    config.write_text(yaml.safe_dump(spec))
    # A Ray of its own, as on a machine with no cluster (`serve run` would join any running one).
    env["RAY_ADDRESS"] = "local"

    # `serve` of the dependencies' venv, run by the new venv's Python (as its own `serve` would be).
    serve_script = REPO_ROOT / ".venv" / "bin" / "serve"
    if not serve_script.exists():
        serve_script = Path(subprocess.check_output(["which", "serve"], text=True).strip())
    log = (installed.elsewhere / "serve.log").open("w")
    run = subprocess.Popen(
        [str(installed.python), str(serve_script), "run", str(config)],
        cwd=installed.elsewhere,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own session: every process it starts can be found after
    )
    base = f"http://127.0.0.1:{port}"
    examples = str(installed.site / "ray_triton_shm" / "examples" / "models")
    tritons: list[int] = []
    actor = -1
    try:
        _wait(
            lambda: run.poll() is not None or _http(f"{base}/v2/models/add_sub/ready", timeout=5)[0] == 200,
            420,
            "the Serve app from the wheel",
        )
        assert run.poll() is None, (installed.elsewhere / "serve.log").read_text()[-4000:]
        a = np.arange(16, dtype=np.int32)
        b = np.full(16, 3, dtype=np.int32)
        request = {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a.tolist()},
                {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b.tolist()},
            ]
        }
        status, body = _http(f"{base}/v2/models/add_sub/infer", request, timeout=120)
        assert status == 200, body[:2000]
        answer = {out["name"]: out for out in json.loads(body)["outputs"]}
        assert answer["OUTPUT0"]["data"] == (a + b).tolist() and answer["OUTPUT0"]["datatype"] == "INT32"
        assert answer["OUTPUT1"]["data"] == (a - b).tolist() and answer["OUTPUT0"]["shape"] == [1, 16]

        # What the run owns: its node Triton (serving the wheel's examples), the node actor that
        # started it, and the segments named after that actor.
        procs = _processes()
        tritons = [
            p for p, (cmd, _, _) in procs.items() if _program(cmd) == "tritonserver" and examples in cmd
        ]
        every = [cmd[:200] for cmd, _, _ in procs.values() if _program(cmd) == "tritonserver"]
        assert len(tritons) == 1, every
        actor = procs[tritons[0]][1]
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{actor}_")]
        assert segments, "the node actor made no pool"
        print(f"serve run from the wheel: add_sub answered {answer['OUTPUT0']['data'][:4]}...;")
        print(f"node Triton pid {tritons[0]} (actor pid {actor}), {len(segments)} segments")
    except BaseException:
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(timeout=120)
        finally:
            time.sleep(10)
            _kill_session(run.pid)
            log.close()
        print((installed.elsewhere / "serve.log").read_text()[-4000:])
        raise
    run.send_signal(signal.SIGTERM)
    try:
        code = run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    log.close()
    serve_log = (installed.elsewhere / "serve.log").read_text()
    assert code is not None, "serve run did not stop on SIGTERM"

    def leftovers() -> list[str]:
        procs = _processes()
        left = [f"{p}: {cmd[:120]}" for p, (cmd, _, sid) in procs.items() if sid == run.pid]
        left += [f"{p}: {procs[p][0][:120]}" for p in tritons if p in procs]
        if actor in procs:
            left.append(f"{actor}: {procs[actor][0][:120]}")
        left += [n for n in os.listdir("/dev/shm") if n.startswith(f"rtshm_{actor}_")]
        return left

    try:
        _wait(lambda: not leftovers(), 90, "the run's processes and segments to go")
    except AssertionError:
        left = leftovers()
        _kill_session(run.pid)
        raise AssertionError(f"left after SIGTERM: {left}\n{serve_log[-3000:]}") from None
    print(f"SIGTERM: serve run exited ({code}); no Triton, actor, segment or process of the run left")
