# Two commands on a fresh clone: `make demo` and `make test`.
# Both create what they need (the client venv here, the Triton server's own
# numpy<2 environment in ~/.cache/ray-triton-shm) and are quick the second time.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: bench-sharing native setup demo test test-slow unit integration cluster-test lint dist bench bench-quick bench-env bench-docs peers soak soak-faults cleanup clean

# nghttp2's headers, for the gRPC engine in C (_h2_engine; installed as root with apt-get when
# missing; elsewhere the package builds without it and its tests are skipped, saying why).
BUILD_DEBS := libnghttp2-dev

$(STAMP): pyproject.toml setup.py ray_triton_shm/_private/serve/protocol/_kserve_json.c \
		ray_triton_shm/_private/serve/http2/_h2_data.c $(wildcard ray_triton_shm/_private/serve/http2/_h2_engine.* ray_triton_shm/_private/serve/http2/h2e_*.c)
	@missing=""; for deb in $(BUILD_DEBS); do dpkg -s $$deb >/dev/null 2>&1 || missing="$$missing $$deb"; done; \
	if [ -n "$$missing" ] && command -v dpkg >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "make: without$$missing the gRPC engine nghttp2 is not built (apt-get install -y$$missing)" >&2; fi; fi
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip 2>/dev/null || true
	$(PIP) -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c "import ray_triton_shm, ray, tritonclient.grpc, pytest"
	touch $(STAMP)

setup: $(STAMP)
	$(PY) -m ray_triton_shm setup

# The native backend (native/rts_native.c) that the models of deployments/native_models
# (KIND_CPU) and deployments/native_models_gpu (KIND_GPU: they load on a machine with a GPU
# only) run on; Triton loads libtriton_rts_native.so from each model's version directory.
# It needs only a C compiler: the tritonserver binary provides every symbol it calls, and
# GPU instances open the CUDA driver (libcuda.so.1) at run time.
NATIVE_SO     := build/native/libtriton_rts_native.so
NATIVE_MODELS := $(patsubst %/config.pbtxt,%/1/libtriton_rts_native.so,$(wildcard deployments/native_models/*/config.pbtxt deployments/native_models_gpu/*/config.pbtxt))

$(NATIVE_SO): native/rts_native.c
	@command -v $(CC) >/dev/null 2>&1 || { echo "make: no C compiler '$(CC)' to build the native Triton backend (install gcc, or run make CC=<compiler>)" >&2; exit 1; }
	@mkdir -p $(dir $@)
	$(CC) -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror -o $@ $<

# A fresh file (mv, not cp over it): a running server may have the old one mapped.
deployments/native_models/%/1/libtriton_rts_native.so: $(NATIVE_SO)
	cp $< $@.tmp && mv -f $@.tmp $@

deployments/native_models_gpu/%/1/libtriton_rts_native.so: $(NATIVE_SO)
	cp $< $@.tmp && mv -f $@.tmp $@

native: $(NATIVE_MODELS)

demo: setup native
	$(PY) -m ray_triton_shm demo

# sdist and wheel in dist/ (the wheel carries the example models and Serve config).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

lint: $(STAMP)
	$(PY) -m ruff check ray_triton_shm tests notebooks tools
	$(PY) -m ruff format --check ray_triton_shm tests tools

# Each Ray test module gets its own process: a Ray started, shut down and started
# again (a multi-node Cluster, then a local Ray) in one process can hang.
RAY_TESTS := $(sort $(wildcard tests/integration/on_ray/test_*.py))
# make test runs its pytest processes two side by side (tests/lanes.py): most of a Ray
# module's time is waiting. TEST_LANES=1 runs one at a time.
TEST_LANES ?= 2

# make test: every test not marked slow (about 15 minutes on 2 cores); make test-slow: the long
# scenarios marked slow (soaks, the benchmark's smoke run, notebooks, multi-node clusters, wheels,
# faults and restarts; about 20 minutes). CI runs both.
# bench-env: the benchmark's smoke test also runs triton-shm-client; its peers (perf_analyzer,
# h2load, nghttp, curl) are what the real-peer tests run unchanged.
test: setup native lint bench-env
	RAY_TRITON_SHM_BENCH_EXTRA=$(abspath $(BENCH_EXTRA)) $(PY) -m tests.lanes --lanes $(TEST_LANES) --tier fast

test-slow: setup native lint bench-env
	RAY_TRITON_SHM_BENCH_EXTRA=$(abspath $(BENCH_EXTRA)) $(PY) -m tests.lanes --lanes $(TEST_LANES) --tier slow

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: setup native
	$(PY) -m pytest tests/integration --ignore=tests/integration/on_ray
	@set -e; for module in $(RAY_TESTS); do $(PY) -m pytest $$module; done

# A Ray cluster of real hosts on this machine (about 6 minutes on 2 cores; needs root): each
# host a network, mount and pid namespace of its own on a bridge (198.18.0.0/15), Ray started on hosts 1-3 by
# cluster.yaml's commands, the Serve app, unmodified tritonclient processes on a client host, a
# Data job from the head, host 3 lost and host 5 joining under load, then the head lost
# (tests/cluster). Not part of `make test`; skipped, with the reason, where namespaces
# cannot be made.
cluster-test: setup
	$(PY) -m pytest tests/cluster -s -p no:cacheprovider

# The benchmark's own extras: matplotlib, h11, h2 and ngh2 (the `bench` extra) in the venv, and
# triton-shm-client, the library compared against, in .cache/bench-extra only
# (--no-deps: it needs just tritonclient.grpc and numpy, both already here).
BENCH_EXTRA := .cache/bench-extra
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PIP) -e '.[dev,bench]' 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) --no-deps --target $(BENCH_EXTRA) --upgrade triton-shm-client==0.1.0 2>&1 | grep -v '^WARNING' || true
	$(PY) -c "import matplotlib, h11, h2, ngh2, sys; sys.path.append('$(BENCH_EXTRA)'); import triton_shm_client"
	touch $(BENCH_STAMP)

# Programs the tests and the benchmark run against, unchanged, outside the package, in
# .cache/peers: Triton's own load generator perf_analyzer (taken from the tritonclient
# 2.49.0 manylinux wheel, the last to carry it), the libcudart.so.12 it links against (the
# nvidia-cuda-runtime-cu12 wheel, in .cache/peers/cuda), and from Debian the libb64 it
# links against, nghttp2's h2load/nghttp and curl (installed as root with apt-get when missing).
PA_VERSION  := 2.49.0
PEERS       := .cache/peers
PEERS_STAMP := $(PEERS)/.installed-$(PA_VERSION)
PEERS_DEBS  := libb64-0d nghttp2-client curl
PA_PLATFORM := $(if $(filter aarch64 arm64,$(shell uname -m)),manylinux2014_aarch64,manylinux1_x86_64)

$(PEERS_STAMP): | $(STAMP)
	@missing=""; for deb in $(PEERS_DEBS); do \
	  dpkg -s $$deb >/dev/null 2>&1 || missing="$$missing $$deb"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	    echo "make peers: Debian packages missing:$$missing; install them as root (apt-get install -y$$missing)" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi
	rm -rf $(PEERS)/wheel $(PEERS)/bin $(PEERS)/cuda
	mkdir -p $(PEERS)/wheel $(PEERS)/bin
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --platform $(PA_PLATFORM) --dest $(PEERS)/wheel tritonclient==$(PA_VERSION)
	$(PY) -c "import sys, zipfile, glob, shutil; \
	  w = zipfile.ZipFile(glob.glob('$(PEERS)/wheel/tritonclient-$(PA_VERSION)-*.whl')[0]); \
	  src = w.open('tritonclient-$(PA_VERSION).data/data/bin/perf_analyzer'); \
	  shutil.copyfileobj(src, open('$(PEERS)/bin/perf_analyzer', 'wb'))"
	chmod 755 $(PEERS)/bin/perf_analyzer
	rm -rf $(PEERS)/wheel
	$(PIP) --no-deps --target $(PEERS)/cuda nvidia-cuda-runtime-cu12 2>&1 | grep -v '^WARNING' || true
	@ls $(PEERS)/cuda/nvidia/cuda_runtime/lib/libcudart.so.12 >/dev/null
	LD_LIBRARY_PATH=$(abspath $(PEERS))/cuda/nvidia/cuda_runtime/lib $(PEERS)/bin/perf_analyzer --version
	touch $@

peers: $(PEERS_STAMP)

bench-env: setup $(BENCH_STAMP) $(PEERS_STAMP)

# Full run (about 8 minutes on 2 cores, 3 rounds per cell), then the front-door table
# (perf_analyzer against the front door, Triton's own endpoints and Serve's proxies, about
# 10 minutes); results in bench-results/ (frontdoor.md and frontdoor.json for the latter).
bench: bench-env native
	RAY_TRITON_SHM_BENCH_EXTRA=$(abspath $(BENCH_EXTRA)) $(PY) -m ray_triton_shm bench
	$(PY) -m ray_triton_shm bench --frontdoor

bench-quick: bench-env native
	RAY_TRITON_SHM_BENCH_EXTRA=$(abspath $(BENCH_EXTRA)) $(PY) -m ray_triton_shm bench --quick
	$(PY) -m ray_triton_shm bench --frontdoor --quick

# What sharing slots between processes costs per 4 KB request (private vs shared pool, same run).
bench-sharing: setup
	$(PY) -m ray_triton_shm bench-sharing --size 4096 --rounds 8

# Paste the latest bench-results/ (the front-door table too) into docs/benchmarks.md and docs/img/.
bench-docs: $(STAMP)
	$(PY) -m ray_triton_shm bench-docs bench-results docs/benchmarks.md

# The full soak (16 callers on 4 slots, 2 minutes through the client and 2 through
# Serve) and the 100000-cycle leak checks; `make test` runs short forms of both.
soak: setup native
	$(PY) -m ray_triton_shm soak --duration 120 --callers 16 --slots 4
	RAY_TRITON_SHM_LEAK_CYCLES=100000 $(PY) -m pytest tests/integration/test_reliability.py -k cycles
	RAY_TRITON_SHM_LEAK_CYCLES=100000 $(PY) -m pytest tests/integration/on_ray/test_leak_ray.py

# Faults under load (10 minutes): 8 tritonclient processes (half HTTP, half gRPC) through the
# ports the config tells clients to use, while a Serve replica, the node actor and the node's
# Triton are SIGKILLed once each; every output value is checked, nothing may be left behind.
# `make test` runs a one-minute form (tests/integration/on_ray/test_soak_faults.py).
SOAK_CONFIG ?= deployments/triton_shm.yaml
soak-faults: setup
	$(PY) -m ray_triton_shm soak-faults --config $(SOAK_CONFIG) --duration 600 --callers 8

cleanup: $(STAMP)
	$(PY) -m ray_triton_shm cleanup --yes

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
