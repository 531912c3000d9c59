#!/usr/bin/env bash
# Builds the GPU binaries here (no GPU needed) for carrying to a GPU host: CPU code for
# x86-64-v3 (any recent x86 host), CUDA for sm_90, and the shared libraries the GPU host lacks
# (Debian's Abseil, Google Benchmark) copied beside them. Result: .gpu-carry/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build-gpu -G Ninja -DCPFILL_CUDA=ON -DCPFILL_CPU_ARCH=x86-64-v3 >/dev/null
cmake --build build-gpu --target attention_cuda_test attention_cuda_bench cpfill -j "$(nproc)"
rm -rf .gpu-carry && mkdir -p .gpu-carry/lib
cp build-gpu/attention/attention_cuda_test build-gpu/bench/attention_cuda_bench build-gpu/cpfill \
   .gpu-carry/
for bin in .gpu-carry/attention_cuda_test .gpu-carry/attention_cuda_bench .gpu-carry/cpfill; do
  ldd "$bin" | awk '/libabsl|libbenchmark|libgtest/ {print $3}'
done | sort -u | xargs -r -I{} cp -L {} .gpu-carry/lib/
du -sh .gpu-carry
