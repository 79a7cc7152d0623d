#!/usr/bin/env bash
# Run the GPU path on a GPU machine from what tools/gpu/pack.sh built: the CUDA tests, the native
# backend's GPU models, Ray (node actor, Serve, Ray Data, the GPU notebook) and the benchmark.
#
# Run from the repository root. Each phase fits one 10-minute device call with room to spare (each
# step has its own limit); files under $WORK (default /tmp/rtshm-gpu) stay between calls on a warm
# machine, so a later call needs to carry only what is new:
#     bash tools/gpu/run.sh ray        # carry .gpu-carry-ray/manifest.json + one part-NN per call: the
#                                      # part is checked and kept under $WORK; once every part is there
#                                      # (and the server kit: carry .gpu-carry in that call, or run
#                                      # `tests` first) Ray is unpacked, imported and its GPU tests run
#     bash tools/gpu/run.sh tests      # carry .gpu-carry: setup (unpack, ~1-2 min) + CUDA tests, the
#                                      # native GPU models + the sanity suite (<= 8 min)
#     bash tools/gpu/run.sh bench      # setup again if the machine is fresh + the benchmarks (<= 8 min)
#     bash tools/gpu/run.sh all        # tests and bench in one go (a machine without a per-call limit)
# Logs and results also go to $OUT when it is set.
# Needs there: python3 (3.12) with numpy 2, cupy and pytest; a GPU; a C compiler for `make native`, or
# build/native/libtriton_rts_native.so carried along. No pip and no xz: wheels are unpacked with
# zipfile, the server env and Ray with tarfile/lzma. Nothing is installed system-wide: everything is
# unpacked under $WORK and reached through PYTHONPATH.
# PYTHON=... picks another interpreter; CPU_DRY_RUN=1 checks the kit on a machine without a GPU (the
# GPU tests then skip and the benchmark is left out).
set -uo pipefail
PY="${PYTHON:-python3}"
PHASE="${1:-tests}"
case "$PHASE" in tests|bench|ray|all) ;; *) echo "usage: run.sh [tests|bench|ray|all]"; exit 2 ;; esac
TESTS_LIMIT_S="${TESTS_LIMIT_S:-330}"   # the pytest steps together, after setup
BENCH_LIMIT_S="${BENCH_LIMIT_S:-420}"   # both benchmark tables together
RAY_LIMIT_S="${RAY_LIMIT_S:-420}"       # the Ray pytest steps together, after setup

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
CARRY_PY="$REPO/tools/gpu/carry.py"
RAY_SITE="$WORK/ray-site"

if [ "$PHASE" = ray ] && [ ! -f "$RAY_SITE/.complete" ]; then
    step "Ray parts (each call carries .gpu-carry-ray/manifest.json and one part; kept in $WORK/ray-parts)"
    if [ -f "$REPO/.gpu-carry-ray/manifest.json" ]; then
        "$PY" "$CARRY_PY" stash "$REPO/.gpu-carry-ray" "$WORK/ray-parts" || die "a carried part does not match its manifest"
    fi
    missing=$("$PY" "$CARRY_PY" missing "$WORK/ray-parts" | tr '\n' ' ')
    if [ -n "${missing// /}" ]; then
        echo "still to carry: $missing(run this again with the next part; a machine given back in between loses the parts)"
        exit 0
    fi
    "$PY" "$CARRY_PY" join "$WORK/ray-parts" "$WORK/ray-site.tar.xz" || die "joining the Ray parts"
    rm -rf "$RAY_SITE"
    "$PY" "$CARRY_PY" extract "$WORK/ray-site.tar.xz" "$RAY_SITE" || die "unpacking Ray"
    rm -rf "$WORK/ray-parts" "$WORK/ray-site.tar.xz"
    # Compiled once here, on every core: a first Ray start that compiles 570 MB of modules as it
    # imports them can outlast the raylet's wait for its agents.
    "$PY" -m compileall -q -j 0 "$RAY_SITE" > /dev/null || echo "(compileall reported errors; Ray compiles as it imports)"
    touch "$RAY_SITE/.complete"
    echo "Ray unpacked into $RAY_SITE"
fi

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

step "native backend (native/rts_native.c) for deployments/native_models and native_models_gpu"
# What `make native` does, without needing make: one compile, the library copied into each model.
if command -v "${CC:-cc}" >/dev/null 2>&1; then
    mkdir -p build/native
    "${CC:-cc}" -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror \
        -o build/native/libtriton_rts_native.so native/rts_native.c || die "compiling native/rts_native.c"
elif [ -f build/native/libtriton_rts_native.so ]; then
    echo "no C compiler: using the carried build/native/libtriton_rts_native.so"
else
    die "no C compiler and no carried build/native/libtriton_rts_native.so (carry build/native)"
fi
for model in deployments/native_models/*/ deployments/native_models_gpu/*/; do
    cp build/native/libtriton_rts_native.so "${model}1/libtriton_rts_native.so.tmp" \
        && mv -f "${model}1/libtriton_rts_native.so.tmp" "${model}1/libtriton_rts_native.so" || die "copying the backend"
done
echo "setup took $(( $(date +%s) - started )) s"

status=0
if [ "$PHASE" = ray ]; then
    export PYTHONPATH="$PYTHONPATH:$RAY_SITE"
    step "Ray imports (Ray's site folder $RAY_SITE, last on PYTHONPATH)"
    "$PY" -c 'import ray, ray.serve, ray.data, nbclient, ipykernel; print("ray", ray.__version__)' || die "Ray imports"
    step "Ray on the GPU: node actor CUDA pools, Serve memory=cuda (handle, front door), Ray Data, the GPU notebook (limit ${RAY_LIMIT_S}s)"
    deadline=$(( $(date +%s) + RAY_LIMIT_S ))
    left() { local n=$(( deadline - $(date +%s) )); [ "$n" -gt 5 ] && echo "$n" || echo 5; }
    for module in tests/integration/on_ray/test_cuda_node.py tests/integration/on_ray/test_gpu_path.py; do
        timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -v "$module" \
            --junitxml="$OUTDIR/ray-junit-$(basename "$module" .py).xml" || status=1
    done
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -v tests/integration/on_ray/test_notebooks.py -k "04_gpu" \
        || status=1
elif [ "$PHASE" != bench ]; then
    step "pytest -m gpu (CUDA tests) + unit tests of the CUDA plumbing (limit ${TESTS_LIMIT_S}s for all tests)"
    deadline=$(( $(date +%s) + TESTS_LIMIT_S ))
    left() { local n=$(( deadline - $(date +%s) )); [ "$n" -gt 5 ] && echo "$n" || echo 5; }
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -v -m gpu tests/integration/test_cuda.py \
        tests/integration/test_native_gpu.py --junitxml="$OUTDIR/gpu-junit.xml" || status=1
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -q tests/unit/test_cuda.py tests/unit/test_cuda_pool.py \
        || status=1

    step "system-memory client tests on this machine (sanity of the carried server)"
    timeout "$(left)" "$PY" -m pytest -p no:cacheprovider -q -x tests/integration/test_client.py || status=1
fi

if [ "$PHASE" = bench ] || [ "$PHASE" = all ]; then
    if [ -n "${CPU_DRY_RUN:-}" ]; then
        step "benchmarks left out (CPU dry run); bench-cuda says so itself:"
        "$PY" -m ray_triton_shm bench-cuda --gpu-model --mb 64 && status=1  # must refuse: no GPU
    else
    bench_deadline=$(( $(date +%s) + BENCH_LIMIT_S ))
    step "GPU model (identity_gpu, rts_native KIND_GPU) at 64 and 256 MB: CUDA shm vs system shm vs gRPC, and cupy's own device-to-device copy"
    timeout "$BENCH_LIMIT_S" "$PY" -m ray_triton_shm bench-cuda --gpu-model --mb 64,256 --repeats 10 \
        --json "$OUTDIR/bench_cuda_gpu_model.json" || status=1
    rest=$(( bench_deadline - $(date +%s) ))
    step "CPU model (Python identity) at 64 MB: CUDA shm vs system shm vs plain gRPC (limit ${rest}s)"
    [ "$rest" -gt 30 ] && { timeout "$rest" "$PY" -m ray_triton_shm bench-cuda --mb 64 --repeats 10 \
        --json "$OUTDIR/bench_cuda_64mb.json" || status=1; }
    fi
fi

step "done ($PHASE): status $status (0 = every step passed) in $(( $(date +%s) - started )) s; log in $OUTDIR/gpu-run-$PHASE.log"
exit $status
