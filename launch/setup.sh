#!/usr/bin/env bash
# Takes a fresh Debian 12 machine (as root) to a built cpfill: installs the Debian packages that
# are missing, configures and builds into ./build. Safe to run again: it only does what is left.
#   bash launch/setup.sh                # then build/cpfill, ctest --test-dir build
# Environment: BUILD_DIR (default build), CPFILL_CUDA (AUTO|ON|OFF, default AUTO),
#              JOBS (default: all cores), BUILD_TARGETS (default: everything; "none":
#              configure only, as tests/run_all.sh does before building what its tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}

# slurm-wlm and munge: tests/slurm runs the Slurm job scripts on a one-node Slurm it starts with
# its own configuration (it needs none of the packages' services);
# libpmix-dev: Slurm's mpi/pmix plugin loads libpmix.so, which only the -dev package provides.
packages=(cmake ninja-build g++ make pkg-config python3 python3-venv curl
          libopenmpi-dev openmpi-bin libabsl-dev libucx-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
          libcpp-httplib-dev libpcre2-dev libssl-dev clang libclang-rt-14-dev
          slurm-wlm munge libpmix-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: run as root (or install these packages first): ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The tests' Python packages, from PyPI, in .venv (tests/CMakeLists.txt's CPFILL_PYTHON): numpy
# for the independent model reference (tests/hf_llama_reference.py), tokenizers (0.20 or later:
# ignore_merges, merges as pairs) for tests/tokenizer_check.py, gguf to dequantize SmolLM2
# (tests/models/convert_smollm2.py, which fetches the model itself), the openai SDK for the
# tests that drive `serve` as its users do. Debian's python3 refuses pip installs into the
# system (PEP 668), hence the venv; it sees the system's packages, so torch and transformers stay
# visible where the system has them (tests/hf_transformers_check.py).
if [ ! -x .venv/bin/python3 ]; then
  echo "setup: making .venv for the tests' Python packages"
  python3 -m venv --system-site-packages .venv
fi
if ! .venv/bin/python3 -c "import numpy, tokenizers, gguf, openai, jinja2
assert tuple(map(int, tokenizers.__version__.split('.')[:2])) >= (0, 20)" 2>/dev/null; then
  echo "setup: installing numpy, tokenizers, gguf, openai and jinja2 into .venv"
  .venv/bin/python3 -m pip install --quiet numpy "tokenizers>=0.20" "gguf>=0.10" "openai>=1.0" "jinja2>=3.0"
fi
# NVIDIA's AIPerf for tests/aiperf_smoke_test.py (label aiperf) and bench/gpu/serve_load.sh, only
# with CPFILL_AIPERF=1 (tests/run_all.sh sets it when the HTTP layer changed): some 100 packages,
# 0.9 GB in .venv, about 2 minutes (measured 2026-12-07: 120 s on 2 cores); pinned, its flags move.
if [ "${CPFILL_AIPERF:-0}" = 1 ] && [ ! -x .venv/bin/aiperf ]; then
  echo "setup: installing aiperf into .venv (CPFILL_AIPERF=1)"
  .venv/bin/python3 -m pip install --quiet "aiperf==0.13.0"
fi

if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCPFILL_CUDA="${CPFILL_CUDA:-AUTO}"
fi
if [ "${BUILD_TARGETS:-}" = none ]; then
  echo "setup: configured $build (BUILD_TARGETS=none: nothing built)"
  exit 0
fi
cmake --build "$build" -j "${JOBS:-$(nproc)}"
echo "setup: built $build/cpfill"
