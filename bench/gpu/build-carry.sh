#!/usr/bin/env bash
# Builds the GPU binaries here (no GPU needed) for carrying to a GPU host: CPU code for
# x86-64-v3 (any recent x86 host), CUDA for sm_90, and the shared libraries the GPU host lacks
# (Debian's Abseil, Google Benchmark, cpp-httplib and its Brotli) copied beside them. Result:
# .gpu-carry/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
launcher=()  # ccache, where installed, makes rebuilds of a few files cheap
command -v ccache >/dev/null &&
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-gpu -G Ninja -DCPFILL_CUDA=ON -DCPFILL_CPU_ARCH=x86-64-v3 -DCPFILL_BUILD_TESTS=ON -DCPFILL_BUILD_BENCH=ON "${launcher[@]}" \
  >/dev/null
bins=(attention/attention_cuda_test bench/attention_cuda_bench cpfill tests/llama_model_cuda_test
      runtime/kv/kv_cache_cuda_test runtime/model/gemv_cuda_test runtime/model/token_draw_cuda_test
      parallel/ucx_transport_test parallel/position_runs_cuda_test
      attention/prefix_batched_cuda_test bench/prefix_attention_cuda_bench
      bench/decode_linear_cuda_bench runtime/model/fp8_gemm_cuda_test bench/fp8_gemm_cuda_bench)
cmake --build build-gpu --target "${bins[@]##*/}" -j "$(nproc)"
rm -rf .gpu-carry && mkdir -p .gpu-carry/lib
for bin in "${bins[@]}"; do cp "build-gpu/$bin" .gpu-carry/; done
for bin in "${bins[@]##*/}"; do
  ldd ".gpu-carry/$bin" | awk '/libabsl|libbenchmark|libgtest|libcpp-httplib|libbrotli|libpcre2/ {print $3}'
done | sort -u | xargs -r -I{} cp -L {} .gpu-carry/lib/
du -sh .gpu-carry
