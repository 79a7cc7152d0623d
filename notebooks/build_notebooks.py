"""Writes the notebooks of this folder from the cell sources below (outputs stripped).

Edit here, then run ``python notebooks/build_notebooks.py``; the notebooks are
executed by ``tests/integration/on_ray/test_notebooks.py`` in ``make test``.
Cells tagged ``gpu`` need an NVIDIA GPU; they also guard themselves, so the
GPU notebook runs (CPU-safe parts only) on any machine.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

FIND_REPO = '''from pathlib import Path

# The repository root (this notebook lives in notebooks/).
REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "deployments" / "models").is_dir())
MODELS = str(REPO / "deployments" / "models")'''

QUICKSTART = [
    new_markdown_cell(
        """# Quick start on a laptop: Triton through shared memory

This notebook starts the **embedded Triton** (the server bundled with
`nvidia-pytriton`, provisioned on first use by `python -m ray_triton_shm setup`),
sends tensors to it through **shared-memory slots** instead of serialising them
over gRPC, and then does the same on a local **Ray** with the per-node actor.

Needs: `pip install -e .` in this repository (or `make setup`). No GPU."""
    ),
    new_code_cell(FIND_REPO),
    new_code_cell(
        '''import time

import numpy as np

from ray_triton_shm import PoolConfig, ServerConfig, TritonServer, TritonShmClient'''
    ),
    new_markdown_cell(
        """## 1. Start Triton and a client

`TritonServer` finds a `tritonserver` binary (yours, or the embedded one), picks
free ports on 127.0.0.1 and waits until every model is ready. The client creates
one pool of slots per model in `/dev/shm` and registers it with Triton once.
`identity` takes variable-length vectors, so its pool needs a largest shape."""
    ),
    new_code_cell(
        '''server = TritonServer(ServerConfig(model_repository=MODELS)).start()
largest = {"INPUT0": (1 << 20,), "OUTPUT0": (1 << 20,)}  # 4 MB of float32
pools = {"identity": PoolConfig(slots=2, max_batch_size=1, max_shapes=largest)}
client = TritonShmClient(url=server.grpc_url, http_url=server.http_url, pools=pools)
print("Triton", server.version, "at", server.grpc_url, f"({server.binary_source})")'''
    ),
    new_markdown_cell("## 2. Infer: numpy in, numpy out"),
    new_code_cell(
        '''a = np.arange(32, dtype=np.int32).reshape(2, 16)
out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
assert out.path == "shm" and (out["OUTPUT0"] == 2 * a).all() and (out["OUTPUT1"] == 0).all()
print(out.path, out["OUTPUT0"][0, :8])'''
    ),
    new_markdown_cell(
        """## 3. Zero copy both ways

`infer_views` hands back read-only views into the slot (valid in the `with`
block); `lease` lets you write inputs in place, so nothing is copied at all."""
    ),
    new_code_cell(
        '''x = np.random.default_rng(0).random((1, 1 << 20), dtype=np.float32)  # 4 MB
with client.infer_views("identity", {"INPUT0": x}) as views:
    assert np.array_equal(views["OUTPUT0"], x)
    print("sum through a view:", float(views["OUTPUT0"].sum()))

with client.lease("multi_io") as lease:
    lease.input("INPUT0", (4, 3, 224, 224))[:] = 0.5
    lease.input("INPUT1", (4, 10))[:] = 1
    views = client.run(lease)
    print({name: view.shape for name, view in views.items()})
    del views  # the slot is reused only once no view points into it'''
    ),
    new_markdown_cell("## 4. Shared memory vs plain gRPC, same server, same tensor"),
    new_code_cell(
        '''def mb_per_s(call, nbytes, repeats=5):
    call()  # warm up
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return nbytes * repeats / (time.perf_counter() - started) / 1e6

shm = mb_per_s(lambda: client.infer("identity", {"INPUT0": x}), x.nbytes)
grpc = mb_per_s(lambda: client.infer_grpc("identity", {"INPUT0": x}), x.nbytes)
print(f"identity 4 MB: shm {shm:.0f} MB/s, gRPC {grpc:.0f} MB/s ({shm / grpc:.1f}x)")'''
    ),
    new_markdown_cell(
        """## 5. Errors are typed, and nothing is sent for a bad input"""
    ),
    new_code_cell(
        '''from ray_triton_shm import InputError

try:
    client.infer("add_sub", {"INPUT0": a.astype(np.float32), "INPUT1": a})
except InputError as e:
    print("InputError:", e)'''
    ),
    new_code_cell(
        '''client.close()   # unregisters and unlinks the pools
server.stop()    # stops Triton (it would also die with this kernel)'''
    ),
    new_markdown_cell(
        """## 6. The same on Ray: one Triton per node, shared by every process

`ensure_node_actors` starts a node actor (and its Triton) on every node;
`NodeClient` in any task or actor uses the Triton of its own node through
slots the actor grants it. An actor stops 30 s after its last user leaves
(`idle_shutdown_s`); a notebook that pauses between cells keeps it with
`idle_shutdown_s=None` until `shutdown_node_actors()`."""
    ),
    new_code_cell(
        '''import ray

from ray_triton_shm.node import NodeClient, NodeConfig, ensure_node_actors, shutdown_node_actors

ray.init(address="local", include_dashboard=False, log_to_driver=False)
ensure_node_actors(NodeConfig.for_repository(MODELS, idle_shutdown_s=None))

@ray.remote(num_cpus=0)
def add_twice(value: int) -> list[int]:
    with NodeClient() as node_client:
        b = np.full((1, 16), value, np.int32)
        return node_client.infer("add_sub", {"INPUT0": b, "INPUT1": b})["OUTPUT0"][0, :3].tolist()

print(ray.get([add_twice.remote(v) for v in range(4)]))'''
    ),
    new_code_cell(
        '''shutdown_node_actors()  # stops Triton and removes the node's segments
ray.shutdown()'''
    ),
]

SERVE = [
    new_markdown_cell(
        """# Ray Serve from a config file, called over HTTP with `tritonclient.http`

The Serve app in `deployments/triton_shm.yaml` speaks the KServe v2 / Triton
HTTP protocol, so an unmodified `tritonclient.http` client works against it.
Behind each replica, tensors go to the node's Triton through shared memory.

From a shell the same file deploys with `serve run deployments/triton_shm.yaml`
(or `serve deploy` on a running cluster). Here we start a local Ray and deploy
it from Python, on free ports (Serve's and the front door's) so nothing else on
this machine is disturbed."""
    ),
    new_code_cell(FIND_REPO),
    new_code_cell(
        '''import socket
import tempfile

import numpy as np
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


spec = yaml.safe_load((REPO / "deployments" / "triton_shm.yaml").read_text())
spec["applications"][0]["deployments"][0]["num_replicas"] = 1  # small for a laptop
config_file = Path(tempfile.mkdtemp()) / "triton_shm.yaml"
# The front door: the replicas' own KServe v2 listeners, the fast path for clients outside Ray.
door = spec["applications"][0]["args"]["frontdoor"]
print(yaml.safe_dump(spec["applications"][0]["args"]))'''
    ),
    new_markdown_cell(
        """A port free now can be taken by another program before it is bound; the app
then fails to start ("Failed to bind", "cannot listen"), and we try again on others."""
    ),
    new_code_cell(
        '''import ray
from ray import serve

from ray_triton_shm.serve import run_config_file

ray.init(address="local", include_dashboard=False, log_to_driver=False)
for attempt in range(3):
    port = free_port()
    spec["http_options"]["port"] = port
    spec["grpc_options"]["port"] = free_port()
    door["http_port"], door["grpc_port"] = free_port(), free_port()
    config_file.write_text(yaml.safe_dump(spec))
    try:
        handles = run_config_file(str(config_file))
        break
    except Exception as e:
        if attempt == 2 or not any(w in str(e) for w in ("Failed to bind", "cannot listen", "in use")):
            raise
        serve.shutdown()
print("Serve app 'triton' at", f"http://127.0.0.1:{port}/", "front door", door)'''
    ),
    new_markdown_cell(
        """## Through the front door

Each replica also listens itself on the app's `frontdoor` ports (`8100` HTTP and `8101`
gRPC in the shipped file): the fast path for clients outside Ray, with no proxy in
between. Any KServe v2 client works there unchanged."""
    ),
    new_code_cell(
        '''import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

x = np.arange(16, dtype=np.float32).reshape(1, 16)
front_http = httpclient.InferenceServerClient(f"127.0.0.1:{door['http_port']}")
tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
tensor.set_data_from_numpy(x, binary_data=True)
assert (front_http.infer("identity", [tensor]).as_numpy("OUTPUT0") == x).all()
front_grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{door['grpc_port']}")
tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
tensor.set_data_from_numpy(x)
assert (front_grpc.infer("identity", [tensor]).as_numpy("OUTPUT0") == x).all()
print("front door: HTTP", door["http_port"], "and gRPC", door["grpc_port"], "answer identity")'''
    ),
    new_markdown_cell("## Over HTTP, exactly as against Triton itself"),
    new_code_cell(
        '''import tritonclient.http as httpclient

http = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
print("live:", http.is_server_live(), " ready:", http.is_server_ready())
print("add_sub inputs:", [i["name"] for i in http.get_model_metadata("add_sub")["inputs"]])

a = np.arange(32, dtype=np.int32).reshape(2, 16)
inputs = []
for name in ("INPUT0", "INPUT1"):
    tensor = httpclient.InferInput(name, list(a.shape), "INT32")
    tensor.set_data_from_numpy(a, binary_data=True)
    inputs.append(tensor)
result = http.infer("add_sub", inputs)
assert (result.as_numpy("OUTPUT0") == 2 * a).all() and (result.as_numpy("OUTPUT1") == 0).all()
print("OUTPUT0[0, :8] =", result.as_numpy("OUTPUT0")[0, :8])'''
    ),
    new_markdown_cell("Bad requests get the HTTP status and error body Triton would send:"),
    new_code_cell(
        '''from tritonclient.utils import InferenceServerException

bad = httpclient.InferInput("INPUT0", [2, 16], "FP32")
bad.set_data_from_numpy(a.astype(np.float32))
try:
    http.infer("add_sub", [bad, inputs[1]])
except InferenceServerException as e:
    print("refused:", e.message())'''
    ),
    new_markdown_cell(
        """## Over the Serve handle: numpy in, numpy out

From Python on the cluster the handle skips HTTP altogether. (In a notebook,
which runs an event loop, `await` the response; in a script use `.result()`.)"""
    ),
    new_code_cell(
        '''handle = serve.get_app_handle("triton")
x = np.random.default_rng(0).random((1, 1 << 18), dtype=np.float32)
out = await handle.infer.remote("identity", {"INPUT0": x})
assert np.array_equal(out["OUTPUT0"], x)
print("where it ran:", await handle.whereami.remote())'''
    ),
    new_code_cell(
        '''from ray_triton_shm.node import shutdown_node_actors

http.close()
serve.shutdown()
shutdown_node_actors()
ray.shutdown()'''
    ),
]

DATA = [
    new_markdown_cell(
        """# Ray Data batch inference through shared memory

`TritonPredictor` is a callable class for `Dataset.map_batches`: each Ray Data
worker leases slots from its node's Triton actor, writes a batch into a slot,
and Triton reads it in place. Here we run the same dataset through shared
memory and through plain gRPC and plot the throughput."""
    ),
    new_code_cell(FIND_REPO),
    new_code_cell(
        '''import time

import numpy as np
import ray

from ray_triton_shm.data import TritonPredictor
from ray_triton_shm.node import NodeConfig, ensure_node_actors, shutdown_node_actors

ray.init(address="local", include_dashboard=False, log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
# Kept until shutdown_node_actors() below, however long you pause between cells.
ensure_node_actors(NodeConfig.for_repository(MODELS, idle_shutdown_s=None))'''
    ),
    new_markdown_cell(
        """A dataset of image-shaped rows for the `multi_io` model (FP32 3x224x224
plus an INT32 vector; it sums the image into 512 numbers)."""
    ),
    new_code_cell(
        '''ROWS = 96
rng = np.random.default_rng(0)
images = rng.random((ROWS, 3, 224, 224), dtype=np.float32)
ds = ray.data.from_items(
    [{"INPUT0": images[i], "INPUT1": np.full(10, i, np.int32)} for i in range(ROWS)]
).materialize()
print(ds.count(), "rows,", round(images.nbytes / 1e6, 1), "MB of images")'''
    ),
    new_code_cell(
        '''def run(grpc: bool, batch_size: int) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    rows = ds.map_batches(
        TritonPredictor,
        fn_constructor_kwargs={"model": "multi_io", "grpc": grpc},
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
        batch_size=batch_size,
        batch_format="numpy",
    ).take_all()
    return images.nbytes / (time.perf_counter() - started) / 1e6, rows

results = {}
for batch_size in (8,):  # multi_io takes batches of up to 8; add sizes to compare
    for grpc in (False, True):
        speed, rows = run(grpc, batch_size)
        got = np.stack([r["OUTPUT0"] for r in rows])
        want = np.stack([r["INPUT0"] for r in rows]).reshape(len(rows), 512, 294).sum(-1)
        assert len(rows) == ROWS and np.allclose(got, want, rtol=1e-4)
        results[("gRPC" if grpc else "shm", batch_size)] = speed
        print(f"batch {batch_size:>3} {'gRPC' if grpc else 'shm ':<4}: {speed:7.1f} MB/s")'''
    ),
    new_markdown_cell(
        """Throughput includes Ray Data's own scheduling and the start of one
predictor actor per run, so on a laptop the difference is smaller than the
raw client numbers of the quick-start notebook; it grows with tensor size."""
    ),
    new_code_cell(
        '''%matplotlib inline
import matplotlib.pyplot as plt

batch_sizes = sorted({b for _, b in results})
width = 0.38
fig, ax = plt.subplots(figsize=(6, 3.5))
for i, path in enumerate(("shm", "gRPC")):
    xs = [j + (i - 0.5) * width for j in range(len(batch_sizes))]
    ax.bar(xs, [results[(path, b)] for b in batch_sizes], width, label=path)
ax.set_xticks(range(len(batch_sizes)), [f"batch {b}" for b in batch_sizes])
ax.set_ylabel("MB/s of input images")
ax.set_title(f"Ray Data -> Triton multi_io, {ROWS} rows")
ax.legend()
plt.show()'''
    ),
    new_code_cell(
        '''shutdown_node_actors()
ray.shutdown()'''
    ),
]

GPU = [
    new_markdown_cell(
        """# GPU cluster walkthrough: CUDA pools and `cluster.yaml`

On a GPU node, tensors that already live on the GPU can go to Triton through
**CUDA shared memory** (CUDA IPC) without a trip through host memory. This
notebook walks through the cluster setup and the CUDA pools.

* Cells tagged **`gpu`** need an NVIDIA GPU, `cupy` (`pip install -e .[cuda]`)
  and a Triton built with CUDA (the image of `deployments/docker/Dockerfile`).
  They check for one themselves and print `skipped: no GPU` otherwise.
* The other cells run anywhere (they are executed in `make test`)."""
    ),
    new_markdown_cell(
        """## 1. The image: Triton and Ray together

`deployments/docker/Dockerfile` starts from NGC's
`nvcr.io/nvidia/tritonserver:24.08-py3` and adds Ray and this package (with
`numpy<2`, which Triton's Python-backend stub needs):

```bash
docker build -f deployments/docker/Dockerfile -t <registry>/ray-triton-shm:latest .
docker push <registry>/ray-triton-shm:latest
```

## 2. The cluster: `cluster.yaml`

A CPU head node (Serve controller and HTTP proxy) and 0-4 autoscaling GPU
workers; containers run with `--ipc=host` so the slot pools get the host's
`/dev/shm`. The head deploys the Serve app from `deployments/triton_shm_gpu.yaml` (replicas on GPU workers).

```bash
ray up cluster.yaml        # fill in the image name first
ray attach cluster.yaml    # then, on the head:  ray-triton-shm status
ray down cluster.yaml
```

The cell below checks the file against Ray's own cluster-config schema."""
    ),
    new_code_cell(FIND_REPO),
    new_code_cell(
        '''import copy

import yaml
from ray.autoscaler._private.util import validate_config

cluster = yaml.safe_load((REPO / "cluster.yaml").read_text())
validate_config(copy.deepcopy(cluster))
print("cluster.yaml is valid for Ray's cluster launcher")
print("image:      ", cluster["docker"]["image"])
print("run options:", " ".join(cluster["docker"]["run_options"]))
for name, node_type in cluster["available_node_types"].items():
    print(f"{name:<11} {node_type['node_config']['InstanceType']:<11} "
          f"workers {node_type['min_workers']}..{node_type['max_workers']}")'''
    ),
    new_markdown_cell("## 3. Is there a GPU here?"),
    new_code_cell(
        '''import shutil


def gpu_available() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False

HAS_GPU = gpu_available()
print("GPU:", HAS_GPU)'''
    ),
    new_markdown_cell(
        """## 4. CUDA pools on each node

A pool with `memory="cuda"` lives in GPU memory (`device_id` picks the GPU);
it is registered with Triton as CUDA shared memory, once per node, by the node
actor. Clients that ask for GPU memory (`NodeClient(memory="cuda")`, or
`"auto"` for models whose instances run on GPU) pass `cupy` arrays and get
`cupy` arrays back; numpy inputs are copied to the GPU once. On a cluster you would connect with
`ray.init(address="auto")` from the head node; here a local Ray is started."""
    ),
    new_code_cell(
        '''if HAS_GPU:
    import ray

    from ray_triton_shm import PoolConfig
    from ray_triton_shm.node import NodeConfig, ensure_node_actors

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    cuda_pools = {
        "multi_io": PoolConfig(slots=4, memory="cuda", device_id=0),
        "identity": PoolConfig(slots=2, max_batch_size=1, memory="cuda", device_id=0,
                               max_shapes={"INPUT0": (1 << 22,), "OUTPUT0": (1 << 22,)}),
    }
    infos = ensure_node_actors(NodeConfig.for_repository(MODELS, pools=cuda_pools, idle_shutdown_s=None))
    for node_id, info in infos.items():
        print(node_id[:12], "Triton", info.version, "at", info.grpc_url)
else:
    print("skipped: no GPU")''',
        metadata={"tags": ["gpu"]},
    ),
    new_code_cell(
        '''if HAS_GPU:
    import cupy as cp

    from ray_triton_shm.node import NodeClient

    with NodeClient(memory="cuda") as client:   # GPU slots; "auto" picks them for GPU models
        x = cp.random.random((1, 1 << 22), dtype=cp.float32)       # 16 MB on the GPU
        out = client.infer("identity", {"INPUT0": x})
        print("path:", out.path, "same data:", bool(cp.array_equal(cp.asarray(out["OUTPUT0"]), x)))
        images = cp.random.random((8, 3, 224, 224), dtype=cp.float32)
        out = client.infer("multi_io", {"INPUT0": images, "INPUT1": cp.ones((8, 10), cp.int32)})
        print("multi_io OUTPUT0:", out["OUTPUT0"].shape, "via", out.path)
else:
    print("skipped: no GPU")''',
        metadata={"tags": ["gpu"]},
    ),
    new_markdown_cell(
        """## 5. Watch it

From the head node (or any machine that can reach the cluster):

```bash
ray-triton-shm status            # per node: Triton, models, pools, bytes by path
ray-triton-shm status --json
```

Prometheus metrics (`ray_triton_shm_requests_total{path="cuda_shm"}`,
`ray_triton_shm_pool_utilization`, ...) appear on each node's metrics port
(`--metrics-export-port=8080` in `cluster.yaml`) and in Ray's Grafana."""
    ),
    new_code_cell(
        '''if HAS_GPU:
    from ray_triton_shm._private.cli import status
    from ray_triton_shm.node import shutdown_node_actors

    print(status.render(status.collect()))
    shutdown_node_actors()
    ray.shutdown()
else:
    print("skipped: no GPU")''',
        metadata={"tags": ["gpu"]},
    ),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_serve_http.ipynb": SERVE,
    "03_ray_data.ipynb": DATA,
    "04_gpu_cluster.ipynb": GPU,
}


def build() -> list[Path]:
    """Write every notebook; returns their paths."""
    written = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        for index, cell in enumerate(nb.cells):
            cell["id"] = f"{Path(name).stem}-{index:02d}"
        nbformat.validate(nb)
        path = HERE / name
        nbformat.write(nb, str(path))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in build():
        print(path)
