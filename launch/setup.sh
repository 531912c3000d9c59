#!/usr/bin/env bash
# Takes a fresh Debian 12 machine (as root) to a built cpfill: installs the Debian packages that
# are missing, configures and builds into ./build. Safe to run again: it only does what is left.
#   bash launch/setup.sh                # then build/cpfill, ctest --test-dir build
# Environment: BUILD_DIR (default build), CPFILL_CUDA (AUTO|ON|OFF, default AUTO),
#              JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}

packages=(cmake ninja-build g++ make pkg-config python3
          libopenmpi-dev openmpi-bin libabsl-dev libucx-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
          libcpp-httplib-dev clang libclang-rt-14-dev)
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

# numpy for the tests' independent model reference (tests/hf_llama_reference.py), from PyPI.
if ! python3 -c "import numpy" 2>/dev/null; then
  echo "setup: installing numpy for the tests"
  python3 -m pip install --quiet numpy
fi

if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCPFILL_CUDA="${CPFILL_CUDA:-AUTO}"
fi
cmake --build "$build" -j "${JOBS:-$(nproc)}"
echo "setup: built $build/cpfill"
