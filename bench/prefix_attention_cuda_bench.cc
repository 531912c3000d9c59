// Prefix-batched attention on the GPU (issue 21): B sequences that share a P-token prefix, each
// with S tokens of its own, as one KV tree (attention/cuda/prefix_batched_cuda.h: the prefix's
// keys read once for every query under it, each suffix apart, merged by LSE).
//   decode:  one query per sequence (its newest token) against P + S keys;
//   suffix:  S queries per sequence (the prefill of its suffix after the cached prefix), causal.
// Timed with CUDA events behind a spin kernel (median of 15 after 3 warm-ups); the prefix K/V
// rotates over copies that together exceed 256 MiB, so every call reads it from HBM. The HBM
// floor reads the prefix once, every suffix, Q, and writes O in bf16, at the device-to-device
// copy rate measured in the same run. bench/gpu/prefix_peer.py times per-sequence peers on the
// same shapes.
//
//   build/bench/prefix_attention_cuda_bench [--quick] > prefix.jsonl   (one JSON object a line)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/prefix_batched_cuda.h"
#include "bench/gpu_spin.h"

namespace cpfill::attention::cuda {
namespace {

constexpr int kDim = 128;
constexpr size_t kRotateBytes = size_t{256} << 20;

struct Shape {
  std::string mode;  // decode | suffix
  int heads, kv_heads;
  int64_t prefix, suffix, batch;
  int64_t queries() const { return mode == "decode" ? batch : batch * suffix; }
};

void* Alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) return nullptr;
  return p;
}

// Random bf16 in [-1, 1] (never zeros: they time differently): up to 4M values drawn on the host,
// the rest copies of them made on the device (drawing gigabytes on the host took minutes).
void FillRandom(__nv_bfloat16* d, size_t n, uint64_t seed) {
  const size_t drawn = std::min<size_t>(n, size_t{1} << 22);
  std::vector<__nv_bfloat16> h(drawn);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : h) x = __float2bfloat16(u(rng));
  cudaMemcpy(d, h.data(), drawn * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
  for (size_t have = drawn; have < n;) {
    const size_t more = std::min(have, n - have);
    cudaMemcpy(d + have, d, more * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice);
    have += more;
  }
}

template <typename Fn>
double MedianUs(Fn&& fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<double> us;
  for (int i = 0; i < 15; ++i) {
    bench::SpinGpu(300'000, nullptr);
    cudaEventRecord(start);
    fn(i);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    us.push_back(ms * 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Device-to-device copy rate: bytes read plus written per second.
double CopyGBps() {
  const size_t bytes = size_t{1} << 30;
  void* a = Alloc(bytes);
  void* b = Alloc(bytes);
  cudaMemset(a, 1, bytes);
  const double us = MedianUs([&](int) { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

// One shape: keys [prefix | suffix 0 | ... | suffix B-1] (the prefix in `copies` rotating
// copies, each followed by the same suffixes), queries of sequence 0, 1, ...
void Run(const Shape& s, double copy_gbps) {
  const int64_t row = int64_t{s.kv_heads} * kDim;
  const int64_t prefix_bytes = 2 * s.prefix * row * 2;
  const int copies = static_cast<int>(std::clamp<int64_t>(
      (kRotateBytes + prefix_bytes - 1) / std::max<int64_t>(prefix_bytes, 1), 1, 16));
  const int64_t kv_tokens = s.prefix * copies + s.batch * s.suffix;
  const int64_t q = s.queries();
  auto* k = static_cast<__nv_bfloat16*>(Alloc(kv_tokens * row * 2));
  auto* v = static_cast<__nv_bfloat16*>(Alloc(kv_tokens * row * 2));
  auto* qd = static_cast<__nv_bfloat16*>(Alloc(q * s.heads * kDim * 2));
  auto* o = static_cast<float*>(Alloc(q * s.heads * kDim * 4));
  auto* lse = static_cast<float*>(Alloc(q * s.heads * 4));
  auto* q_pos = static_cast<int32_t*>(Alloc(q * 4));
  auto* k_pos = static_cast<int32_t*>(Alloc(kv_tokens * 4));
  if (!k || !v || !qd || !o || !lse || !q_pos || !k_pos) {
    std::printf("{\"mode\":\"%s\",\"prefix\":%ld,\"batch\":%ld,\"error\":\"out of memory\"}\n",
                s.mode.c_str(), s.prefix, s.batch);
    for (void* p :
         {(void*)k, (void*)v, (void*)qd, (void*)o, (void*)lse, (void*)q_pos, (void*)k_pos}) {
      cudaFree(p);
    }
    return;
  }
  FillRandom(k, kv_tokens * row, 1);
  FillRandom(v, kv_tokens * row, 2);
  FillRandom(qd, q * s.heads * kDim, 3);
  std::vector<int32_t> kp(kv_tokens), qp;
  for (int c = 0; c < copies; ++c) {
    for (int64_t i = 0; i < s.prefix; ++i) kp[c * s.prefix + i] = static_cast<int32_t>(i);
  }
  const int64_t suffix0 = s.prefix * copies;
  std::vector<SequenceSlice> suffixes;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.suffix; ++i) {
      kp[suffix0 + b * s.suffix + i] = static_cast<int32_t>(s.prefix + i);
    }
    const int64_t rows = s.mode == "decode" ? 1 : s.suffix;
    for (int64_t i = 0; i < rows; ++i) {
      qp.push_back(static_cast<int32_t>(s.prefix + s.suffix - rows + i));
    }
    suffixes.push_back({.q_begin = b * rows,
                        .q_len = rows,
                        .kv_begin = suffix0 + b * s.suffix,
                        .kv_len = s.suffix});
  }
  cudaMemcpy(k_pos, kp.data(), kp.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(q_pos, qp.data(), qp.size() * 4, cudaMemcpyHostToDevice);
  const AttentionShape shape{.num_heads = s.heads,
                             .num_kv_heads = s.kv_heads,
                             .head_dim = kDim,
                             .softmax_scale = 1.0f / std::sqrt(float(kDim)),
                             .causal = true};
  const CudaAttentionArgs args{.shape = shape,
                               .q = qd,
                               .q_pos = q_pos,
                               .q_tokens = q,
                               .k = k,
                               .v = v,
                               .k_pos = k_pos,
                               .kv_tokens = kv_tokens,
                               .o = o,
                               .lse = lse};
  std::vector<std::vector<SequenceSlice>> levels(copies);
  for (int c = 0; c < copies; ++c) {
    levels[c] = {{.q_begin = 0, .q_len = q, .kv_begin = c * s.prefix, .kv_len = s.prefix}};
  }
  const std::span<const SequenceSlice> first[] = {levels[0], suffixes};
  const size_t ws_bytes = PrefixBatchedWorkspaceBytes(args, first);
  void* ws = Alloc(ws_bytes);
  std::string error;
  const double us = MedianUs([&](int i) {
    const std::span<const SequenceSlice> tree[] = {levels[i % copies], suffixes};
    absl::Status st = PrefixBatchedAttentionCuda(args, tree, ws, ws_bytes, nullptr);
    if (!st.ok()) error = std::string(st.message());
  });
  const double floor_bytes =
      double(s.prefix + s.batch * s.suffix) * row * 2 * 2 + double(q) * s.heads * kDim * 2 * 2;
  const double floor_us = floor_bytes / (copy_gbps * 1e9) * 1e6;
  std::printf(
      "{\"impl\":\"cpfill-tree\",\"mode\":\"%s\",\"heads\":%d,\"kv_heads\":%d,\"prefix\":%ld,"
      "\"suffix\":%ld,\"batch\":%ld,\"us\":%.2f,\"floor_us\":%.2f%s%s%s}\n",
      s.mode.c_str(), s.heads, s.kv_heads, s.prefix, s.suffix, s.batch, us, floor_us,
      error.empty() ? "" : ",\"error\":\"", error.c_str(), error.empty() ? "" : "\"");
  std::fflush(stdout);
  for (void* p :
       {(void*)k, (void*)v, (void*)qd, (void*)o, (void*)lse, (void*)q_pos, (void*)k_pos, ws}) {
    cudaFree(p);
  }
}

// The grid: prefixes 1K-64K, 8:1 and 32:8 heads, decode with suffixes of 1 and 2K keys
// at batch 1-256, and suffix prefills of 256 and 2K tokens at batches up to 64K query tokens.
std::vector<Shape> Grid(bool quick) {
  std::vector<Shape> grid;
  const std::vector<int64_t> prefixes =
      quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{1024, 4096, 16384, 65536};
  for (const auto& [heads, kv_heads] : {std::pair{8, 1}, std::pair{32, 8}}) {
    for (int64_t p : prefixes) {
      for (int64_t suffix : {int64_t{1}, int64_t{2048}}) {
        for (int64_t b : {1, 8, 32, 64, 256})
          grid.push_back({"decode", heads, kv_heads, p, suffix, b});
      }
      for (int64_t suffix : {int64_t{256}, int64_t{2048}}) {
        for (int64_t b : {1, 8, 32, 256}) {
          if (b * suffix <= 65536) grid.push_back({"suffix", heads, kv_heads, p, suffix, b});
        }
      }
    }
  }
  return grid;
}

}  // namespace
}  // namespace cpfill::attention::cuda

int main(int argc, char** argv) {
  using namespace cpfill::attention::cuda;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "prefix_attention_cuda_bench: no CUDA device visible\n");
    return 77;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const double gbps = CopyGBps();
  std::printf("{\"copy_GBps\":%.1f}\n", gbps);
  for (const Shape& s : Grid(quick)) Run(s, gbps);
  return 0;
}
