// Prefill feed-forward GEMMs of Llama-3-8B in row-wise FP8 (runtime/model/cuda/fp8_gemm.h)
// against cuBLASLt FP8 with per-tensor scales and bf16, in the same process on the same device:
//
//   fp8_gemm_cuda_bench [TOKENS...]        (default 8192 16384 32768 65536 131072)
//
// Shapes: up/gate (in 4096 -> out 14336) and down (14336 -> 4096), bf16 output. Per shape and
// token count, the median of 10 timed runs (after 3 warm-ups) of:
//   bf16            Gemm::Linear, bf16 operands
//   fp8_tensor      cuBLASLt FP8, one scale per operand (the per-tensor baseline)
//   fp8_row_outer   cuBLASLt FP8 with outer-vector (row-wise) scales on both sides, if offered
//   fp8_row_outer_fast   the same with fast accumulation (fbgemm's use_fast_accum)
//   fp8_row_epi     cuBLASLt FP8 unit scales -> fp32, then the scaling kernel (extra traffic)
//   quantize        the per-token activation quantization (bf16 -> E4M3), alone
// TFLOP/s = 2 * tokens * in * out / time (quantize: GB/s of bf16 read + E4M3 written). One JSON
// object per line on stdout after the table, for bench/results/.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "runtime/model/cuda/fp8_gemm.h"
#include "runtime/model/cuda/gemm.h"

namespace {

using cpfill::runtime::cuda::Fp8Gemm;
using cpfill::runtime::cuda::Fp8GemmArgs;
using cpfill::runtime::cuda::Fp8ScaleMode;
using cpfill::runtime::cuda::Gemm;
using cpfill::runtime::cuda::OutType;

constexpr int kWarmups = 3, kRuns = 10;

void Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "fp8_gemm_cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}
void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "fp8_gemm_cuda_bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  Check(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc");
  return p;
}

// bf16 in [-1, 1) on the device: a random block of 1M values (an odd length, so rows do not
// repeat), tiled; generating gigabytes on the host would cost the GPU host's time.
void* RandomBf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<__nv_bfloat16> host((size_t{1} << 20) - 7);
  for (auto& x : host) x = __float2bfloat16(d(rng));
  void* p = Alloc(n * 2);
  for (size_t done = 0; done < n; done += host.size()) {
    const size_t count = std::min(host.size(), n - done);
    Check(cudaMemcpy(static_cast<char*>(p) + done * 2, host.data(), count * 2,
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
  return p;
}
void* FilledFloats(size_t n, float v) {
  std::vector<float> host(n, v);
  void* p = Alloc(n * 4);
  Check(cudaMemcpy(p, host.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  return p;
}

double MedianUs(const std::function<void()>& run, cudaStream_t stream) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> us;
  for (int i = 0; i < kWarmups + kRuns; ++i) {
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    run();
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= kWarmups) us.push_back(ms * 1e3f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> token_list = {8192, 16384, 32768, 65536, 131072};
  if (argc > 1) token_list.clear();
  for (int i = 1; i < argc; ++i) token_list.push_back(std::atoll(argv[i]));
  const int64_t max_tokens = *std::max_element(token_list.begin(), token_list.end());
  const int64_t kHidden = 4096, kFfn = 14336;
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  Gemm bf16;
  Fp8Gemm fp8, fp8_fast;
  Check(bf16.Init(stream), "Gemm::Init");
  Check(fp8.Init(stream, false), "Fp8Gemm::Init");
  Check(fp8_fast.Init(stream, true), "Fp8Gemm::Init");
  std::printf("%s (fp8_row = cuBLASLt outer-vector scales; 0 where cuBLASLt does not offer them)\n",
              prop.name);

  // Operands sized for the largest shape; x doubles as bf16 activations, codes for FP8.
  const size_t max_x = size_t(max_tokens) * kFfn, max_y = size_t(max_tokens) * kFfn;
  void* x_bf16 = RandomBf16(max_x, 1);
  void* w_bf16 = RandomBf16(size_t(kHidden) * kFfn, 2);
  auto* xq = static_cast<uint8_t*>(Alloc(max_x));
  auto* wq = static_cast<uint8_t*>(Alloc(size_t(kHidden) * kFfn));
  auto* x_scale = static_cast<float*>(Alloc(max_tokens * 4));
  auto* w_scale = static_cast<float*>(FilledFloats(kFfn, 1.f / 448));
  void* y = Alloc(max_y * 2);
  auto* acc = static_cast<float*>(Alloc(max_y * 4));
  // Real E4M3 codes, from quantizing bf16 data (weights as a [14336, 4096] "activation").
  Check(cpfill::runtime::cuda::QuantizeRowsFp8(static_cast<const __nv_bfloat16*>(w_bf16), kFfn,
                                               kHidden, 0.f, wq, w_scale, stream),
        "quantize w");

  std::vector<std::string> json;
  std::printf("%8s %13s %8s %8s %8s %8s %8s %8s %9s\n", "tokens", "in->out", "bf16", "fp8_tens",
              "fp8_row", "row_fast", "row_epi", "row+q", "quant_us");
  for (const auto& [in, out] : {std::pair{kHidden, kFfn}, std::pair{kFfn, kHidden}}) {
    for (int64_t t : token_list) {
      Check(cpfill::runtime::cuda::QuantizeRowsFp8(static_cast<const __nv_bfloat16*>(x_bf16), t, in,
                                                   1200.f, xq, x_scale, stream),
            "quantize x");
      const Fp8GemmArgs g{xq, x_scale, wq, w_scale, t, in, out};
      const bool outer = fp8.ModeFor(g, OutType::kBfloat16) == Fp8ScaleMode::kOuterVector &&
                         fp8_fast.ModeFor(g, OutType::kBfloat16) == Fp8ScaleMode::kOuterVector;
      const double flop = 2.0 * t * in * out;
      auto tflops = [&](double us) { return us > 0 ? flop / us / 1e6 : 0.0; };
      auto fp8_run = [&](Fp8Gemm& gemm, Fp8ScaleMode mode) {
        return MedianUs([&] { Check(gemm.Linear(g, y, OutType::kBfloat16, mode, acc), "fp8"); },
                        stream);
      };
      const double us_bf16 = MedianUs(
          [&] {
            Check(
                bf16.Linear(static_cast<const __nv_bfloat16*>(x_bf16), t, in,
                            static_cast<const __nv_bfloat16*>(w_bf16), out, y, OutType::kBfloat16),
                "bf16");
          },
          stream);
      const double us_tensor = fp8_run(fp8_fast, Fp8ScaleMode::kPerTensor);
      const double us_outer = outer ? fp8_run(fp8, Fp8ScaleMode::kOuterVector) : 0;
      const double us_outer_fast = outer ? fp8_run(fp8_fast, Fp8ScaleMode::kOuterVector) : 0;
      const double us_epi = fp8_run(fp8, Fp8ScaleMode::kEpilogue);
      const double us_quant = MedianUs(
          [&] {
            Check(cpfill::runtime::cuda::QuantizeRowsFp8(static_cast<const __nv_bfloat16*>(x_bf16),
                                                         t, in, 1200.f, xq, x_scale, stream),
                  "quantize");
          },
          stream);
      const double us_row = outer ? us_outer : us_epi;
      std::printf("%8lld %6lld->%-6lld %8.0f %8.0f %8.0f %8.0f %8.0f %8.0f %9.0f\n",
                  static_cast<long long>(t), static_cast<long long>(in),
                  static_cast<long long>(out), tflops(us_bf16), tflops(us_tensor), tflops(us_outer),
                  tflops(us_outer_fast), tflops(us_epi), tflops(us_row + us_quant), us_quant);
      char line[512];
      std::snprintf(line, sizeof(line),
                    "{\"device\":\"%s\",\"tokens\":%lld,\"in\":%lld,\"out\":%lld,"
                    "\"us\":{\"bf16\":%.1f,\"fp8_tensor\":%.1f,\"fp8_row_outer\":%.1f,"
                    "\"fp8_row_outer_fast\":%.1f,\"fp8_row_epilogue\":%.1f,\"quantize\":%.1f}}",
                    prop.name, static_cast<long long>(t), static_cast<long long>(in),
                    static_cast<long long>(out), us_bf16, us_tensor, us_outer, us_outer_fast,
                    us_epi, us_quant);
      json.push_back(line);
    }
  }
  std::printf(
      "(TFLOP/s; fp8_tens: per-tensor scales, fast accumulation; row+q: the row-wise GEMM "
      "plus the activation quantization)\n");
  for (const std::string& j : json) std::printf("%s\n", j.c_str());
  return 0;
}
