#!/usr/bin/env bash
# Build what a GPU machine without a package registry needs to run the GPU path, in pieces that each
# fit one device call (at most 64 MiB carried per call, the tracked files included).
#
# The lender's GPU machine has Python 3.12, numpy 2, torch, cupy-cuda13x, grpcio and protobuf, but
# no tritonserver, no tritonclient and no Ray. Two kits:
#
# tools/gpu/pack.sh [server]  -> .gpu-carry/ (one call):
#   server-env.tar.xz   site-packages of the Triton server's own Python env: the pytriton 0.7.0
#                       tritonserver tree with only the Python 3.12 backend stub, its bundled
#                       libraries, and numpy 1.26.4 (the stub needs numpy < 2; it never reaches
#                       the client, which keeps the machine's numpy 2 for cupy)
#   client/*.whl        tritonclient and what it imports that may be missing or too old there
#                       (python-rapidjson, grpcio, protobuf, and ml_dtypes and packaging, which
#                       tritonclient 2.73 imports at module level; typing_extensions, which grpc.aio
#                       imports, and urllib3, a declared dependency: small, so not left to the image)
#
# tools/gpu/pack.sh ray       -> .gpu-carry-ray/ (one call per part):
#   part-NN, manifest.json  Ray with its serve and data extras, and nbclient/ipykernel for the
#                       notebooks, at the versions of this checkout's .venv (`make setup`), as
#                       CPython 3.12 x86-64 wheels, minus what the machine has (tools/gpu/carry.py
#                       MACHINE_HAS); unpacked into one site folder, packed as a .tar.xz and cut
#                       into parts that each fit one call beside the tracked files. Each call
#                       carries manifest.json and one part; run.sh keeps the parts under $WORK and
#                       joins them (sizes and SHA-256 checked) once all have arrived.
#
# tools/gpu/pack.sh all       -> both.
# Needs pip access here (once) to download; compression uses Python's lzma (no xz binary).
# Usage: tools/gpu/pack.sh [server|ray|all]   (from anywhere; writes under <repo>/)
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CARRY="$REPO/.gpu-carry"
PY=3.12
PYTRITON=nvidia-pytriton==0.7.0
NUMPY=numpy==1.26.4
CLIENT_WHEELS=(tritonclient==2.73.0 python-rapidjson==1.22 grpcio==1.85.1 protobuf==6.33.6
    ml_dtypes==0.5.4 packaging==26.3 typing_extensions==4.16.0 urllib3==2.8.0)
LIMIT=$((64 * 1024 * 1024))

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() {  # download DEST SPEC... : binary wheels for CPython 3.12 on x86-64 Linux
    local dest="$1"; shift
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY" --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_35_x86_64 \
        --platform manylinux1_x86_64 \
        --platform any -d "$dest" "$@" 2>&1 | grep -v '^WARNING' || true
}

MODE="${1:-server}"
case "$MODE" in server|ray|all) ;; *) echo "usage: pack.sh [server|ray|all]" >&2; exit 2 ;; esac
CARRY_PY="$REPO/tools/gpu/carry.py"
# Ray's roots: the extras the Serve app and Ray Data use, and what runs the notebooks.
RAY_ROOTS=("ray[serve,data]" nbclient nbformat ipykernel)
repo_bytes() { (cd "$REPO" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1); }

pack_server() {
echo "downloading $PYTRITON and $NUMPY for Python $PY ..."
download "$work/wheels" "$PYTRITON" "$NUMPY"
site="$work/site"
mkdir -p "$site"
python3 - "$work/wheels" "$site" "$PY" <<'PYEOF'
import pathlib, shutil, sys, zipfile
wheels, site, py = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.startswith("pytriton/") and not name.startswith("pytriton/tritonserver/"):
                continue  # only the server tree; the pytriton Python package is not used
            if "/python_backend_stubs/" in name and f"/python_backend_stubs/{py}/" not in name:
                continue
            if name.startswith("numpy/") and "/tests/" in name:
                continue
            z.extract(info, site)
            mode = info.external_attr >> 16
            if mode:
                (site / name).chmod(mode & 0o777)
tree = site / "pytriton" / "tritonserver"
stub = tree / "python_backend_stubs" / py / "triton_python_backend_stub"
if not stub.is_file():
    sys.exit(f"no Python {py} stub in the pytriton wheel")
shutil.copy2(stub, tree / "backends" / "python" / stub.name)
shutil.rmtree(tree / "python_backend_stubs")
PYEOF

rm -rf "$CARRY"
mkdir -p "$CARRY/client"
echo "compressing the server env (lzma preset 9; a few minutes) ..."
python3 - "$site" "$CARRY/server-env.tar.xz" <<'PYEOF'
import sys, tarfile
with tarfile.open(sys.argv[2], "w:xz", preset=9) as tar:
    tar.add(sys.argv[1], arcname=".")
PYEOF
download "$CARRY/client" "${CLIENT_WHEELS[@]}"

total=$(du -cb "$CARRY" | tail -1 | cut -f1)
repo=$(cd "$REPO" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
ls -la "$CARRY" "$CARRY/client"
for wheel in tritonclient python_rapidjson grpcio protobuf ml_dtypes packaging typing_extensions urllib3; do
    compgen -G "$CARRY/client/${wheel}-*.whl" > /dev/null || { echo "no $wheel wheel was downloaded" >&2; exit 1; }
done
echo "carry: $((total / 1024)) KiB; tracked repo files: $((repo / 1024)) KiB; limit $((LIMIT / 1024)) KiB"
if [ $((total + repo)) -gt "$LIMIT" ]; then
    echo "too big for the 64 MiB limit" >&2
    exit 1
fi
}

pack_ray() {
local venv_py="$REPO/.venv/bin/python"
[ -x "$venv_py" ] || { echo "no $venv_py: run make setup first (Ray's versions come from it)" >&2; exit 1; }
local specs budget
mapfile -t specs < <("$venv_py" "$CARRY_PY" closure "${RAY_ROOTS[@]}")
[ "${#specs[@]}" -gt 0 ] || { echo "no distributions to carry" >&2; exit 1; }
echo "downloading ${#specs[@]} wheels for Python $PY (${RAY_ROOTS[*]}, at this venv's versions) ..."
download "$work/ray-wheels" "${specs[@]}"
"$venv_py" "$CARRY_PY" site "$work/ray-wheels" "$work/ray-site" "${specs[@]}"  # fails naming a missing wheel
echo "compressing Ray's site folder (lzma preset 1; a few minutes) ..."
"$venv_py" "$CARRY_PY" archive "$work/ray-site" "$work/ray-site.tar.xz"
budget=$("$venv_py" "$CARRY_PY" budget --limit "$LIMIT" --repo "$(repo_bytes)")
rm -rf "$REPO/.gpu-carry-ray"
"$venv_py" "$CARRY_PY" split "$work/ray-site.tar.xz" "$REPO/.gpu-carry-ray" --part-bytes "$budget"
printf '%s\n' "${specs[@]}" > "$REPO/.gpu-carry-ray/wheels.txt"
ls -la "$REPO/.gpu-carry-ray"
echo "each call carries .gpu-carry-ray/manifest.json and one part (at most $((budget / 1024)) KiB)"
}

case "$MODE" in
    server) pack_server ;;
    ray) pack_ray ;;
    all) pack_server; pack_ray ;;
esac
