// The CUDA attention kernel and merge: TFLOP/s and GB/s with CUDA events (median of the
// iterations Google Benchmark chooses, after a warm-up launch).
//
// FLOPs count only what the mask leaves visible: 4 * head_dim * heads * visible (q, k) pairs
// (causal: the unmasked half). Shapes: the per-GPU attention of Llama-3-405B on TP8 (16 query
// heads, 1 KV head, head dim 128) and of Llama-3-8B (32 / 8), causal and not, 4K to 32K tokens;
// a fused batch of mixed lengths against the same tokens as one sequence; the merge of 4
// partials in GB/s (bytes read + written); partial prefills (1K to 16K new tokens after
// 128K - new cached, bottom-right causal); decode steps (one query per sequence against its own
// 32K or 128K keys, batch 1 to 32) in GB/s of K/V read against the HBM floor.
//
//   build/bench/attention_cuda_bench --benchmark_out=cuda.json --benchmark_out_format=json
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention/attention.h"
#include "attention/cuda/attention_cuda.h"
#include "bench/gpu_spin.h"
#include "benchmark/benchmark.h"

namespace cpfill::attention::cuda {
namespace {

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  return p;
}

// Random bf16 in [-1, 1] on the device (never zeros: they time differently).
void FillRandom(__nv_bfloat16* d, size_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> h(n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : h) x = __float2bfloat16(u(rng));
  cudaMemcpy(d, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
}

// Fills n bf16 values on the device with random numbers in [-1, 1]: one random block uploaded,
// then copied device to device (a host loop over gigabytes would take minutes). The copies
// repeat, which neither the attention kernels nor the memory-bound ones notice.
void FillRandomLarge(__nv_bfloat16* d, size_t n, uint64_t seed) {
  const size_t block = std::min<size_t>(n, size_t{16} << 20);
  FillRandom(d, block, seed);
  for (size_t done = block; done < n; done += block) {
    cudaMemcpy(d + done, d, std::min(block, n - done) * sizeof(__nv_bfloat16),
               cudaMemcpyDeviceToDevice);
  }
}

AttentionShape BenchShape(int heads, int kv_heads, int dim, bool causal) {
  return {.num_heads = heads,
          .num_kv_heads = kv_heads,
          .head_dim = dim,
          .softmax_scale = 1.0f / std::sqrt(float(dim)),
          .causal = causal};
}

// A fused batch of sequences on the device: each prefills `lengths[i]` new tokens after `cached`
// keys of its own (0: a full prefill), so its queries sit at positions cached .. cached + n - 1
// and the causal mask is aligned to the bottom right.
struct Batch {
  std::vector<SequenceSlice> slices;
  int64_t q_tokens = 0, kv_tokens = 0;
  int heads, kv_heads, dim;
  bool causal;
  __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  int32_t *q_pos = nullptr, *k_pos = nullptr;
  float* lse = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  double flops = 0;

  Batch(const std::vector<int64_t>& lengths, int h, int kvh, int d, bool c, int64_t cached = 0)
      : heads(h), kv_heads(kvh), dim(d), causal(c) {
    std::vector<int32_t> hq, hk;
    for (int64_t n : lengths) {
      slices.push_back({q_tokens, n, kv_tokens, cached + n});
      for (int64_t i = 0; i < n; ++i) hq.push_back(static_cast<int32_t>(cached + i));
      for (int64_t i = 0; i < cached + n; ++i) hk.push_back(static_cast<int32_t>(i));
      q_tokens += n;
      kv_tokens += cached + n;
      const double pairs =
          causal ? double(n) * cached + n * (n + 1) / 2.0 : double(n) * (cached + n);
      flops += 4.0 * d * h * pairs;
    }
    q = static_cast<__nv_bfloat16*>(DeviceAlloc(q_tokens * h * d * 2));
    k = static_cast<__nv_bfloat16*>(DeviceAlloc(kv_tokens * kvh * d * 2));
    v = static_cast<__nv_bfloat16*>(DeviceAlloc(kv_tokens * kvh * d * 2));
    o = static_cast<__nv_bfloat16*>(DeviceAlloc(q_tokens * h * d * 2));
    lse = static_cast<float*>(DeviceAlloc(q_tokens * h * 4));
    q_pos = static_cast<int32_t*>(DeviceAlloc(q_tokens * 4));
    k_pos = static_cast<int32_t*>(DeviceAlloc(kv_tokens * 4));
    // Partial prefills after 128K keys fill up to 268M values: uploaded as repeated blocks.
    FillRandomLarge(q, q_tokens * h * d, 1);
    FillRandomLarge(k, kv_tokens * kvh * d, 2);
    FillRandomLarge(v, kv_tokens * kvh * d, 3);
    cudaMemcpy(q_pos, hq.data(), q_tokens * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(k_pos, hk.data(), kv_tokens * 4, cudaMemcpyHostToDevice);
    ws_bytes = AttentionWorkspaceBytes(Args());
    ws = DeviceAlloc(ws_bytes + 16);
  }
  ~Batch() {
    for (void* p :
         {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)q_pos, (void*)k_pos, ws}) {
      cudaFree(p);
    }
  }
  CudaAttentionArgs Args() const {
    return {.shape = BenchShape(heads, kv_heads, dim, causal),
            .q = q,
            .q_pos = q_pos,
            .q_tokens = q_tokens,
            .k = k,
            .v = v,
            .k_pos = k_pos,
            .kv_tokens = kv_tokens,
            .slices = slices.data(),
            .num_slices = static_cast<int64_t>(slices.size()),
            .output = OutputMode::kBfloat16,
            .o = o,
            .lse = lse};
  }
};

// Times `fn` with CUDA events, one event pair per benchmark iteration; `before` runs ahead of
// each iteration's start event (untimed).
void Nothing() {}
template <typename Fn, typename Before = void (*)()>
void TimeWithEvents(benchmark::State& state, Fn fn, Before before = Nothing) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  if (!fn().ok()) {  // warm-up: module load, attribute set-up
    state.SkipWithError("launch failed");
    return;
  }
  cudaDeviceSynchronize();
  for (auto _ : state) {
    before();
    cudaEventRecord(start);
    absl::Status s = fn();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    if (!s.ok()) {
      state.SkipWithError("launch failed");
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
  }
  if (cudaGetLastError() != cudaSuccess) state.SkipWithError("CUDA error");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

void BM_Attention(benchmark::State& state) {
  const int heads = state.range(0), kv_heads = state.range(1), dim = state.range(2);
  const int64_t tokens = state.range(3);
  const bool causal = state.range(4) != 0;
  Batch b({tokens}, heads, kv_heads, dim, causal);
  const CudaAttentionArgs a = b.Args();
  TimeWithEvents(state, [&] { return PartialAttentionCuda(a, b.ws, b.ws_bytes, nullptr); });
  state.counters["TFLOPs"] =
      benchmark::Counter(b.flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

// The same 16K tokens as one sequence and as a fused batch of mixed lengths.
void BM_AttentionMixed(benchmark::State& state) {
  const int heads = state.range(0), kv_heads = state.range(1);
  std::vector<int64_t> lengths;
  if (state.range(2) == 0) {
    lengths = {16384};
  } else {
    lengths = {6144, 4096, 2048, 1536, 1024, 768, 512, 256, 64, 16, 8, 8};  // 16384 in all
  }
  Batch b(lengths, heads, kv_heads, 128, true);
  const CudaAttentionArgs a = b.Args();
  TimeWithEvents(state, [&] { return PartialAttentionCuda(a, b.ws, b.ws_bytes, nullptr); });
  state.counters["TFLOPs"] =
      benchmark::Counter(b.flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["sequences"] = lengths.size();
}

// A partial prefill: `new_tokens` queries after 128K - new_tokens cached keys of the same
// sequence (a long prompt's last chunk, a turn after a long history), causal.
void BM_AttentionPartial(benchmark::State& state) {
  const int heads = state.range(0), kv_heads = state.range(1);
  const int64_t new_tokens = state.range(2), context = 131072;
  Batch b({new_tokens}, heads, kv_heads, 128, true, context - new_tokens);
  const CudaAttentionArgs a = b.Args();
  TimeWithEvents(state, [&] { return PartialAttentionCuda(a, b.ws, b.ws_bytes, nullptr); });
  state.counters["TFLOPs"] =
      benchmark::Counter(b.flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Merge(benchmark::State& state) {
  const int parts = state.range(0);
  const int64_t rows = state.range(1), heads = 16, dim = 128;
  std::vector<float*> o(parts), lse(parts);
  std::vector<const float*> co(parts), cl(parts);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> ho(rows * heads * dim), hl(rows * heads);
  for (int s = 0; s < parts; ++s) {
    for (auto& x : ho) x = u(rng);
    for (auto& x : hl) x = 5.f * u(rng);
    o[s] = static_cast<float*>(DeviceAlloc(ho.size() * 4));
    lse[s] = static_cast<float*>(DeviceAlloc(hl.size() * 4));
    cudaMemcpy(o[s], ho.data(), ho.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(lse[s], hl.data(), hl.size() * 4, cudaMemcpyHostToDevice);
    co[s] = o[s];
    cl[s] = lse[s];
  }
  float* out = static_cast<float*>(DeviceAlloc(ho.size() * 4));
  float* out_lse = static_cast<float*>(DeviceAlloc(hl.size() * 4));
  const AttentionShape shape{
      .num_heads = static_cast<int>(heads), .num_kv_heads = 1, .head_dim = static_cast<int>(dim)};
  TimeWithEvents(state, [&] {
    return MergePartialsCuda(shape, rows, co, cl, out, nullptr, out_lse, nullptr);
  });
  const double bytes = double(parts + 1) * rows * heads * (dim + 1) * 4;
  state.counters["GBps"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  for (int s = 0; s < parts; ++s) {
    cudaFree(o[s]);
    cudaFree(lse[s]);
  }
  cudaFree(out);
  cudaFree(out_lse);
}

// The device's copy bandwidth in bytes moved (read + written) per second: the median of 10
// device-to-device copies of 1 GiB, measured once per process. The decode floor is the K/V
// bytes read at this rate.
double CopyBandwidthBytesPerSecond() {
  static const double bw = [] {
    const size_t bytes = size_t{1} << 30;
    void* a = DeviceAlloc(bytes);
    void* b = DeviceAlloc(bytes);
    if (a == nullptr || b == nullptr) return 0.0;
    cudaMemset(a, 1, bytes);
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<float> ms(10);
    for (float& t : ms) {
      cudaEventRecord(start);
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      cudaEventElapsedTime(&t, start, stop);
    }
    std::sort(ms.begin(), ms.end());
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (ms[ms.size() / 2] / 1e3);
  }();
  return bw;
}

// Copies of `bytes` that together exceed 256 MiB (at most 16): rotated over, every timed
// iteration reads its data from HBM, not from the 50 MiB L2.
int CopiesBeyondL2(double bytes) {
  return static_cast<int>(std::clamp((256e6 + bytes - 1) / bytes, 1.0, 16.0));
}

// The counters of a memory-bound timing over `bytes` read per iteration: GB/s, and the floor
// (those bytes at the copy bandwidth) with the bandwidth it used.
void SetFloorCounters(benchmark::State& state, double bytes) {
  const double bw = CopyBandwidthBytesPerSecond();
  state.counters["GBps"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["floor_us"] = bw > 0 ? bytes / bw * 1e6 : 0;
  state.counters["copy_GBps"] = bw / 1e9;
}

// A decode step: `batch` sequences of `context` keys each (own K/V), one query each at the last
// position. The K/V of successive iterations rotate over copies that together exceed 256 MiB,
// so every iteration reads them from HBM (one 16 MiB copy would stay in the 50 MiB L2), and
// each iteration is queued behind a 100 us spin (gpu_spin.h): the host's launch latency is
// out of the timed window and L2 holds no dirty lines to write back.
void BM_Decode(benchmark::State& state) {
  const int64_t context = state.range(0), batch = state.range(1);
  const int heads = state.range(2), kv_heads = state.range(3), dim = 128;
  const int64_t kv_tokens = context * batch;
  const size_t kv_values = static_cast<size_t>(kv_tokens) * kv_heads * dim;
  const double kv_bytes = 2.0 * kv_values * sizeof(__nv_bfloat16);
  const int copies = CopiesBeyondL2(kv_bytes);
  auto* q = static_cast<__nv_bfloat16*>(DeviceAlloc(batch * heads * dim * 2));
  auto* k = static_cast<__nv_bfloat16*>(DeviceAlloc(copies * kv_values * 2));
  auto* v = static_cast<__nv_bfloat16*>(DeviceAlloc(copies * kv_values * 2));
  auto* o = static_cast<__nv_bfloat16*>(DeviceAlloc(batch * heads * dim * 2));
  auto* lse = static_cast<float*>(DeviceAlloc(batch * heads * 4));
  auto* q_pos = static_cast<int32_t*>(DeviceAlloc(batch * 4));
  auto* k_pos = static_cast<int32_t*>(DeviceAlloc(kv_tokens * 4));
  if (!q || !k || !v || !o || !lse || !q_pos || !k_pos) {
    state.SkipWithError("device allocation failed");
    return;
  }
  FillRandom(q, batch * heads * dim, 1);
  FillRandomLarge(k, copies * kv_values, 2);
  FillRandomLarge(v, copies * kv_values, 3);
  std::vector<int32_t> hq(batch, static_cast<int32_t>(context - 1)), hk(kv_tokens);
  std::vector<SequenceSlice> slices;
  for (int64_t b = 0; b < batch; ++b) {
    slices.push_back({b, 1, b * context, context});
    for (int64_t i = 0; i < context; ++i) hk[b * context + i] = static_cast<int32_t>(i);
  }
  cudaMemcpy(q_pos, hq.data(), batch * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(k_pos, hk.data(), kv_tokens * 4, cudaMemcpyHostToDevice);
  std::vector<CudaAttentionArgs> args;
  for (int c = 0; c < copies; ++c) {
    args.push_back({.shape = BenchShape(heads, kv_heads, dim, true),
                    .q = q,
                    .q_pos = q_pos,
                    .q_tokens = batch,
                    .k = k + c * kv_values,
                    .v = v + c * kv_values,
                    .k_pos = k_pos,
                    .kv_tokens = kv_tokens,
                    .slices = slices.data(),
                    .num_slices = batch,
                    .output = OutputMode::kBfloat16,
                    .o = o,
                    .lse = lse});
  }
  const size_t ws_bytes = AttentionWorkspaceBytes(args[0]);
  void* ws = DeviceAlloc(ws_bytes + 16);
  int64_t it = 0;
  TimeWithEvents(
      state, [&] { return PartialAttentionCuda(args[it++ % copies], ws, ws_bytes, nullptr); },
      [] { bench::SpinGpu(100'000, nullptr); });
  SetFloorCounters(state, kv_bytes);
  state.counters["kv_MB"] = kv_bytes / 1e6;
  state.counters["kv_copies"] = copies;
  for (void* p :
       {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)q_pos, (void*)k_pos, ws}) {
    cudaFree(p);
  }
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (auto [h, kvh] : {std::pair{16, 1}, std::pair{32, 8}}) {
    for (int causal : {1, 0}) {
      for (int64_t t : {4096, 8192, 16384, 32768}) b->Args({h, kvh, 128, t, causal});
    }
  }
  b->Args({16, 1, 64, 16384, 1});
  b->ArgNames({"heads", "kv_heads", "dim", "tokens", "causal"});
}

BENCHMARK(BM_Attention)->Apply(Shapes)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionMixed)
    ->Args({16, 1, 0})
    ->Args({16, 1, 1})
    ->Args({32, 8, 0})
    ->Args({32, 8, 1})
    ->ArgNames({"heads", "kv_heads", "mixed"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionPartial)
    ->ArgsProduct({{16}, {1}, {1024, 2048, 4096, 8192, 16384}})
    ->ArgsProduct({{32}, {8}, {1024, 2048, 4096, 8192, 16384}})
    ->ArgNames({"heads", "kv_heads", "new_tokens"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)
    ->ArgsProduct({{32768, 131072}, {1, 8, 32}, {16}, {1}})
    ->ArgsProduct({{32768, 131072}, {1, 8, 32}, {32}, {8}})
    ->ArgNames({"context", "batch", "heads", "kv_heads"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// One read-only kernel over the bytes of a decode shape's K+V (KiB; BM_Decode's kv_MB in MB),
// rotating over copies beyond L2 as BM_Decode does: what a single memory-bound kernel of this
// size costs, launch and drain included, next to the copy bandwidth's floor.
void BM_ReadFloor(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) << 10;
  const int ctas = static_cast<int>(state.range(1));
  const int copies = CopiesBeyondL2(static_cast<double>(bytes));
  char* data = static_cast<char*>(DeviceAlloc(copies * bytes));
  auto* sink = static_cast<uint32_t*>(DeviceAlloc(4));
  if (data == nullptr || sink == nullptr) {
    state.SkipWithError("device allocation failed");
    return;
  }
  cudaMemset(data, 1, copies * bytes);
  int64_t it = 0;
  TimeWithEvents(
      state,
      [&] {
        bench::ReadGpu(data + (it++ % copies) * bytes, bytes, ctas, sink, nullptr);
        return cudaGetLastError() == cudaSuccess ? absl::OkStatus() : absl::InternalError("read");
      },
      [] { bench::SpinGpu(100'000, nullptr); });
  SetFloorCounters(state, static_cast<double>(bytes));
  cudaFree(data);
  cudaFree(sink);
}

BENCHMARK(BM_ReadFloor)
    ->ArgsProduct({{64, 16 << 10, 64 << 10, 128 << 10, 512 << 10}, {132, 264, 1056}})
    ->ArgNames({"KiB", "ctas"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_Merge)
    ->Args({4, 16384})
    ->Args({8, 16384})
    ->ArgNames({"parts", "rows"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace cpfill::attention::cuda

int main(int argc, char** argv) {
  if (cpfill::attention::cuda::DeviceCount() == 0) {
    std::printf("no CUDA device: nothing to benchmark\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("attention_kernel", cpfill::attention::cuda::AttentionKernelName());
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
