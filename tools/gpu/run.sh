#!/usr/bin/env bash
# Run the CUDA tests and the 64 MB CUDA/system/gRPC comparison on a GPU machine, from .gpu-carry/.
#
# Run from the repository root after tools/gpu/pack.sh built .gpu-carry/ (carry it along), in two
# calls so that each fits a 10-minute device call with room to spare (each step has its own limit):
#     bash tools/gpu/run.sh tests      # setup (unpack, ~1-2 min) + CUDA tests + sanity suite (<= 8 min)
#     bash tools/gpu/run.sh bench      # setup again if the machine is fresh + the benchmark (<= 8 min)
#     bash tools/gpu/run.sh all        # both in one go (a machine without a per-call limit)
# Logs and results also go to $OUT when it is set.
# Needs there: python3 (3.12) with numpy 2, cupy and pytest; a GPU. No pip and no xz: wheels are
# unpacked with zipfile, the server env with tarfile/lzma. Nothing is installed system-wide: the
# server env and client packages are unpacked under $WORK (default /tmp/rtshm-gpu).
# PYTHON=... picks another interpreter; CPU_DRY_RUN=1 checks the kit on a machine without a GPU (the
# GPU tests then skip and the benchmark is left out).
set -uo pipefail
PY="${PYTHON:-python3}"
PHASE="${1:-tests}"
case "$PHASE" in tests|bench|all) ;; *) echo "usage: run.sh [tests|bench|all]"; exit 2 ;; esac
TESTS_LIMIT_S="${TESTS_LIMIT_S:-330}"   # the pytest steps together, after setup
BENCH_LIMIT_S="${BENCH_LIMIT_S:-360}"

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CARRY="$REPO/.gpu-carry"
WORK="${WORK:-/tmp/rtshm-gpu}"
OUTDIR="${OUT:-$WORK/out}"
mkdir -p "$WORK" "$OUTDIR"
exec > >(tee "$OUTDIR/gpu-run-$PHASE.log") 2>&1
started=$(date +%s)
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
if [ ! -x "$site/pytriton/tritonserver/bin/tritonserver" ]; then
    "$PY" - "$CARRY/server-env.tar.xz" "$site" <<'PYEOF' || die "unpacking server-env.tar.xz"
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    tar.extractall(sys.argv[2], filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(sys.argv[2])
PYEOF
fi
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

step "client packages (tritonclient and the wheels it needs, carried) on PYTHONPATH only"
client_site="$WORK/client-site"
if [ ! -d "$client_site/tritonclient" ]; then
    # A wheel is a zip of site-packages; its <name>.data/{purelib,platlib} go there too.
    "$PY" - "$client_site" "$CARRY"/client/*.whl <<'PYEOF' || die "unpacking the client wheels"
import pathlib, shutil, sys, zipfile
site = pathlib.Path(sys.argv[1])
site.mkdir(parents=True, exist_ok=True)
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
for data in site.glob("*.data"):
    for kind in ("purelib", "platlib"):
        if (data / kind).is_dir():
            shutil.copytree(data / kind, site, dirs_exist_ok=True)
    shutil.rmtree(data)
print("unpacked", len(sys.argv) - 2, "wheels")
PYEOF
fi
export PYTHONPATH="$client_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export RAY_TRITON_SHM_SERVER_PYTHON_ENV="$env_dir"
export RAY_TRITON_SHM_CACHE_DIR="$WORK/cache"
export PYTHONUNBUFFERED=1
"$PY" -c 'import tritonclient.grpc, tritonclient.utils, ray_triton_shm; print("tritonclient + ray_triton_shm import")' \
    || die "client imports"
echo "setup took $(( $(date +%s) - started )) s"

status=0
if [ "$PHASE" != bench ]; then
    step "pytest -m gpu (CUDA tests) + unit tests of the CUDA plumbing (limit ${TESTS_LIMIT_S}s for all tests)"
    deadline=$(( $(date +%s) + TESTS_LIMIT_S ))
    left() { local n=$(( deadline - $(date +%s) )); [ "$n" -gt 5 ] && echo "$n" || echo 5; }
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -v -m gpu tests/integration/test_cuda.py \
        --junitxml="$OUTDIR/gpu-junit.xml" || status=1
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -q tests/unit/test_cuda.py tests/unit/test_cuda_pool.py \
        || status=1

    step "system-memory client tests on this machine (sanity of the carried server)"
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -q -x tests/integration/test_client.py || status=1
fi

if [ "$PHASE" != tests ] && [ -z "${CPU_DRY_RUN:-}" ]; then
    step "64 MB: CUDA shm vs system shm vs plain gRPC (limit ${BENCH_LIMIT_S}s)"
    timeout "$BENCH_LIMIT_S" "$PY" -m ray_triton_shm bench-cuda --mb 64 --repeats 10 \
        --json "$OUTDIR/bench_cuda_64mb.json" || status=1
fi

step "done ($PHASE): status $status (0 = every step passed) in $(( $(date +%s) - started )) s; log in $OUTDIR/gpu-run-$PHASE.log"
exit $status
