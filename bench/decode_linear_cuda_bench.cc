// The linear layers of a decode step (LlamaModel::Decode): one Llama-3-8B layer's seven GEMMs
// (q, k, v, o, gate, up, down; bf16 weights, fp32 accumulation) at 1..32 token rows, on the
// small-batch kernel (runtime/model/cuda/gemv.h, up to its row limit) and through the model's
// Gemm::Linear (which takes that kernel at one row, cuBLASLt otherwise; with
// CPFILL_DECODE_GEMV=0, cuBLASLt always):
//
//   decode_linear_cuda_bench [ROWS...]          (default 1 2 3 4 5 6 7 8 12 16 32)
//
// Prints per row count the median of 50 timed layers (after 5 warm-ups; four layer copies
// rotated, 1.7 GB, beyond L2; each layer queued behind a spin so launches stay out of the window)
// and the weights' bytes per second.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "base/knobs.h"
#include "bench/gpu_spin.h"
#include "runtime/model/cuda/gemm.h"
#include "runtime/model/cuda/gemv.h"

namespace {

using cpfill::runtime::cuda::Gemm;
using cpfill::runtime::cuda::OutType;
using cpfill::runtime::cuda::SmallBatchLinear;
using cpfill::runtime::cuda::SmallBatchLinearApplies;

constexpr int kHidden = 4096, kKv = 1024, kFfn = 14336, kCopies = 4, kWarmups = 5, kRuns = 50;
struct Shape {
  int in, out;
};
constexpr Shape kLayer[] = {{kHidden, kHidden}, {kHidden, kKv},  {kHidden, kKv}, {kHidden, kHidden},
                            {kHidden, kFfn},    {kHidden, kFfn}, {kFfn, kHidden}};

void Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "decode_linear_cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

__nv_bfloat16* RandomBf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  std::vector<__nv_bfloat16> host(n);
  for (auto& x : host) x = __float2bfloat16(d(rng));
  void* p = nullptr;
  Check(cudaMalloc(&p, n * 2), "cudaMalloc");
  Check(cudaMemcpy(p, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  return static_cast<__nv_bfloat16*>(p);
}

// The median time of one layer's GEMMs at `rows` rows, on the small-batch kernel or Gemm::Linear.
double MedianLayerUs(Gemm& gemm, const std::vector<std::vector<__nv_bfloat16*>>& weights,
                     const __nv_bfloat16* x, float* y, int rows, bool small_batch,
                     cudaStream_t stream) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> us;
  for (int run = 0; run < kWarmups + kRuns; ++run) {
    const std::vector<__nv_bfloat16*>& w = weights[run % kCopies];
    cpfill::bench::SpinGpu(200'000, stream);
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (size_t g = 0; g < std::size(kLayer); ++g) {
      const absl::Status s =
          small_batch
              ? SmallBatchLinear(x, rows, kLayer[g].in, w[g], kLayer[g].out, y, true, stream)
              : gemm.Linear(x, rows, kLayer[g].in, w[g], kLayer[g].out, y, OutType::kFloat32);
      if (!s.ok()) {
        std::fprintf(stderr, "decode_linear_cuda_bench: %s\n", s.ToString().c_str());
        std::exit(1);
      }
    }
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (run >= kWarmups) us.push_back(ms * 1e3f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  // A malformed knob (CPFILL_DECODE_GEMV=yes) is refused, as cpfill refuses it at start-up,
  // rather than measured at the default under the wrong name.
  if (const absl::Status s = cpfill::knobs::Validate(); !s.ok()) {
    std::fprintf(stderr, "decode_linear_cuda_bench: %s\n", s.ToString().c_str());
    return 2;
  }
  std::vector<int> rows_list = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32};
  if (argc > 1) rows_list.clear();
  for (int i = 1; i < argc; ++i) rows_list.push_back(std::atoi(argv[i]));
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  Gemm gemm;
  if (!gemm.Init(stream).ok()) return 1;
  std::vector<std::vector<__nv_bfloat16*>> weights(kCopies);
  size_t weight_bytes = 0;
  for (int c = 0; c < kCopies; ++c) {
    for (size_t g = 0; g < std::size(kLayer); ++g) {
      weights[c].push_back(RandomBf16(size_t{1} * kLayer[g].in * kLayer[g].out, c * 16 + g));
      if (c == 0) weight_bytes += size_t{2} * kLayer[g].in * kLayer[g].out;
    }
  }
  const int max_rows = *std::max_element(rows_list.begin(), rows_list.end());
  __nv_bfloat16* x = RandomBf16(size_t{1} * max_rows * kFfn, 99);
  float* y = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&y), size_t{4} * max_rows * kFfn), "cudaMalloc");
  // The knob as Gemm::Linear reads it (runtime/model/cuda/gemv.cu): the value in effect.
  namespace knobs = cpfill::knobs;
  std::printf("%s=%d%s: one 8B layer's 7 GEMMs, %.0f MB of weights\n",
              std::string(knobs::kDecodeGemv).c_str(), knobs::Bool(knobs::kDecodeGemv) ? 1 : 0,
              knobs::IsSet(knobs::kDecodeGemv) ? "" : " (default)", weight_bytes / 1e6);
  std::printf("%5s %16s %10s %16s %10s\n", "rows", "small-batch us", "GB/s", "Gemm::Linear us",
              "GB/s");
  for (int rows : rows_list) {
    std::printf("%5d", rows);
    for (bool small_batch : {true, false}) {
      if (small_batch && !SmallBatchLinearApplies(rows, kHidden, x, weights[0][0], y)) {
        std::printf(" %16s %10s", "-", "-");
        continue;
      }
      const double us = MedianLayerUs(gemm, weights, x, y, rows, small_batch, stream);
      std::printf(" %16.1f %10.0f", us, weight_bytes / us / 1e3);
    }
    std::printf("\n");
  }
  return 0;
}
