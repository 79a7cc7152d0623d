#!/usr/bin/env bash
# Run the CUDA tests and the 64 MB CUDA/system/gRPC comparison on a GPU machine, from .gpu-carry/.
#
# Run from the repository root after tools/gpu/pack.sh built .gpu-carry/ (carry it along):
#     bash tools/gpu/run.sh            # logs and results also go to $OUT when it is set
# Needs there: python3 (3.12) with numpy 2, cupy and pytest; a GPU. Nothing is installed system-wide:
# the server env and client packages are unpacked under $WORK (default /tmp/rtshm-gpu).
# PYTHON=... picks another interpreter; CPU_DRY_RUN=1 checks the kit on a machine without a GPU (the
# GPU tests then skip and the benchmark is left out).
set -uo pipefail
PY="${PYTHON:-python3}"

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CARRY="$REPO/.gpu-carry"
WORK="${WORK:-/tmp/rtshm-gpu}"
OUTDIR="${OUT:-$WORK/out}"
mkdir -p "$WORK" "$OUTDIR"
exec > >(tee "$OUTDIR/gpu-run.log") 2>&1
cd "$REPO"

step() { printf '\n=== %s\n' "$*"; }
die() { echo "FAILED: $*"; exit 1; }

step "machine"
if [ -n "${CPU_DRY_RUN:-}" ]; then
    echo "CPU dry run: no GPU checks"
else
nvidia-smi -L || die "no nvidia-smi / GPU"
"$PY" -c 'import sys, numpy, cupy; print(sys.version); print("numpy", numpy.__version__, "cupy", cupy.__version__, "gpus", cupy.cuda.runtime.getDeviceCount())' || die "python3 with cupy needed"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())' || echo "(no torch: the DLPack test will skip)"
fi
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$pyver" = "3.12" ] || die "the carried server stub is for Python 3.12, this is $pyver"

step "server env (numpy 1.26 for the Python-backend stub only)"
env_dir="$WORK/server-env"
if [ ! -x "$env_dir/bin/python3" ]; then
    "$PY" -m venv --without-pip "$env_dir" 2>/dev/null || {
        # No venv module: the same layout by hand (the stub finds its prefix from bin/python3 on PATH).
        base=$("$PY" -c 'import sys; print(sys._base_executable)')
        mkdir -p "$env_dir/bin"
        ln -sf "$base" "$env_dir/bin/python3"; ln -sf python3 "$env_dir/bin/python"
        printf 'home = %s\ninclude-system-site-packages = false\nversion = %s\n' "$(dirname "$base")" \
            "$("$PY" -c 'import platform; print(platform.python_version())')" > "$env_dir/pyvenv.cfg"
    }
fi
site="$env_dir/lib/python$pyver/site-packages"
mkdir -p "$site"
[ -x "$site/pytriton/tritonserver/bin/tritonserver" ] || xz -dc "$CARRY/server-env.tar.xz" | tar -C "$site" -xf - \
    || die "unpacking server-env.tar.xz"
"$env_dir/bin/python3" -c 'import numpy; print("server env numpy", numpy.__version__)' || die "server env numpy"

stub="$site/pytriton/tritonserver/backends/python/triton_python_backend_stub"
libs="$site/nvidia_pytriton.libs"
missing=$(LD_LIBRARY_PATH="$libs" ldd "$stub" | grep 'not found' || true)
if [ -n "$missing" ]; then
    # The stub links libpython3.12.so; a uv / standalone Python keeps it in <base prefix>/lib.
    base_lib=$("$PY" -c 'import sys, os; print(os.path.join(sys.base_prefix, "lib"))')
    export LD_LIBRARY_PATH="$base_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    missing=$(LD_LIBRARY_PATH="$libs:$LD_LIBRARY_PATH" ldd "$stub" | grep 'not found' || true)
fi
[ -z "$missing" ] || die "the Python-backend stub misses libraries: $missing"

step "client packages (tritonclient, rapidjson, grpcio, protobuf) on PYTHONPATH only"
client_site="$WORK/client-site"
if [ ! -d "$client_site/tritonclient" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$client_site" \
        "$CARRY"/client/*.whl || die "installing the client wheels"
fi
export PYTHONPATH="$client_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export RAY_TRITON_SHM_SERVER_PYTHON_ENV="$env_dir"
export RAY_TRITON_SHM_CACHE_DIR="$WORK/cache"
export PYTHONUNBUFFERED=1
"$PY" -c 'import tritonclient.grpc, ray_triton_shm; print("tritonclient + ray_triton_shm import")' \
    || die "client imports"

status=0
step "pytest -m gpu (CUDA tests) + unit tests of the CUDA plumbing"
"$PY" -m pytest -p no:cacheprovider -v -m gpu tests/integration/test_cuda.py \
    --junitxml="$OUTDIR/gpu-junit.xml" || status=1
"$PY" -m pytest -p no:cacheprovider -q tests/unit/test_cuda.py || status=1

step "system-memory client tests on this machine (sanity of the carried server)"
"$PY" -m pytest -p no:cacheprovider -q tests/integration/test_client.py || status=1

if [ -z "${CPU_DRY_RUN:-}" ]; then
    step "64 MB: CUDA shm vs system shm vs plain gRPC"
    "$PY" -m ray_triton_shm._private.bench_cuda --mb 64 --repeats 10 --json "$OUTDIR/bench_cuda_64mb.json" \
        || status=1
fi

step "done: status $status (0 = every step passed); log in $OUTDIR/gpu-run.log"
exit $status
