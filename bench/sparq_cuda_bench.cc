// SparQ decode attention on the GPU (attention/sparq/cuda/sparq_cuda.h) beside cpfill's dense
// decode kernel, on the same K/V: time per call (CUDA events, Google Benchmark manual time) and
// bytes by model: the paper's M_SparQ (eq. 9; K stored S-contiguous), this implementation's
// 32-byte sectors of the gathered K components plus its workspace traffic, and the dense K + V.
// Floors are those bytes at the device's copy bandwidth.
//
//   build-attn/bench/sparq_cuda_bench --benchmark_format=json --benchmark_min_time=0.05s
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <random>
#include <vector>

#include "attention/cuda/attention_cuda.h"
#include "attention/sparq/cuda/sparq_cuda.h"
#include "bench/gpu_spin.h"
#include "benchmark/benchmark.h"

namespace cpfill {
namespace {

using attention::SequenceSlice;
using attention::sparq::SparqConfig;
using attention::sparq::SparqShape;
namespace sq = attention::sparq::cuda;
namespace dense = attention::cuda;

constexpr int kHeads = 32, kKvHeads = 8, kDim = 128;

// One K and one V buffer for every shape, grown as needed and kept for the process; shapes
// smaller than 256 MB rotate over copies inside it so each call reads from HBM, not L2.
struct KvStore {
  size_t values = 0;
  __nv_bfloat16 *k = nullptr, *v = nullptr;
  bool Reserve(size_t n) {
    if (n <= values) return true;
    cudaFree(k);
    cudaFree(v);
    values = 0;
    if (cudaMalloc(reinterpret_cast<void**>(&k), n * 2) != cudaSuccess ||
        cudaMalloc(reinterpret_cast<void**>(&v), n * 2) != cudaSuccess) {
      return false;
    }
    Fill(k, n, 1);
    Fill(v, n, 2);
    values = n;
    return true;
  }
  static void Fill(__nv_bfloat16* d, size_t n, uint64_t seed) {
    const size_t block = std::min<size_t>(n, size_t{16} << 20);
    std::vector<__nv_bfloat16> h(block);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto& x : h) x = __float2bfloat16(u(rng));
    cudaMemcpy(d, h.data(), block * 2, cudaMemcpyHostToDevice);
    for (size_t done = block; done < n; done += block) {
      cudaMemcpy(d + done, d, std::min(block, n - done) * 2, cudaMemcpyDeviceToDevice);
    }
  }
};
KvStore& Store() {
  static KvStore s;
  return s;
}

int Copies(double bytes) {
  return static_cast<int>(std::clamp((256e6 + bytes - 1) / bytes, 1.0, 16.0));
}

double CopyBandwidth() {
  static const double bw = [] {
    const size_t bytes = size_t{1} << 30;
    void *a = nullptr, *b = nullptr;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0.0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> ms(7);
    for (float& t : ms) {
      cudaEventRecord(e0);
      cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      cudaEventElapsedTime(&t, e0, e1);
    }
    std::sort(ms.begin(), ms.end());
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (ms[ms.size() / 2] / 1e3);
  }();
  return bw;
}

template <typename Launch>
void TimeCalls(benchmark::State& state, Launch launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (auto _ : state) {
    bench::SpinGpu(100'000, nullptr);  // host launch latency out of the timed window
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(ms / 1e3);
  }
  if (cudaGetLastError() != cudaSuccess) state.SkipWithError("a CUDA call failed");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// Per-sequence inputs shared by both kernels: q, positions, slices, begins, v_sum.
struct Inputs {
  __nv_bfloat16* q = nullptr;
  int64_t *begin = nullptr, *len = nullptr;
  int32_t *q_pos = nullptr, *k_pos = nullptr;
  float *v_sum = nullptr, *o = nullptr, *lse = nullptr;
  void* ws = nullptr;
  std::vector<SequenceSlice> slices;
  Inputs(int64_t context, int64_t batch) {
    cudaMalloc(reinterpret_cast<void**>(&q), batch * kHeads * kDim * 2);
    KvStore::Fill(q, batch * kHeads * kDim, 3);
    std::vector<int64_t> b(batch), l(batch, context);
    std::vector<int32_t> qp(batch, static_cast<int32_t>(context - 1)), kp(context * batch);
    for (int64_t s = 0; s < batch; ++s) {
      b[s] = s * context;
      slices.push_back({s, 1, s * context, context});
      for (int64_t i = 0; i < context; ++i) kp[s * context + i] = static_cast<int32_t>(i);
    }
    cudaMalloc(reinterpret_cast<void**>(&begin), batch * 8);
    cudaMalloc(reinterpret_cast<void**>(&len), batch * 8);
    cudaMalloc(reinterpret_cast<void**>(&q_pos), batch * 4);
    cudaMalloc(reinterpret_cast<void**>(&k_pos), kp.size() * 4);
    cudaMemcpy(begin, b.data(), batch * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(len, l.data(), batch * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(q_pos, qp.data(), batch * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(k_pos, kp.data(), kp.size() * 4, cudaMemcpyHostToDevice);
    cudaMalloc(reinterpret_cast<void**>(&v_sum), batch * kKvHeads * kDim * 4);
    cudaMemset(v_sum, 0, batch * kKvHeads * kDim * 4);
    cudaMalloc(reinterpret_cast<void**>(&o), batch * kHeads * kDim * 4);
    cudaMalloc(reinterpret_cast<void**>(&lse), batch * kHeads * 4);
  }
  ~Inputs() {
    for (void* p : {(void*)q, (void*)begin, (void*)len, (void*)q_pos, (void*)k_pos, (void*)v_sum,
                    (void*)o, (void*)lse, ws}) {
      cudaFree(p);
    }
  }
};

void SetBytes(benchmark::State& state, const char* name, double bytes) {
  const double bw = CopyBandwidth();
  state.counters[std::string(name) + "_MB"] = bytes / 1e6;
  state.counters[std::string(name) + "_floor_us"] = bw > 0 ? bytes / bw * 1e6 : 0;
}

void BM_Sparq(benchmark::State& state) {
  const int64_t context = state.range(0), batch = state.range(1);
  const SparqConfig config{.r = static_cast<int>(state.range(2)),
                           .k = static_cast<int>(state.range(3)),
                           .local_window = 16};
  const SparqShape shape{kHeads, kKvHeads, kDim};
  const size_t values = static_cast<size_t>(context) * batch * kKvHeads * kDim;
  const int copies = Copies(4.0 * values);
  if (!Store().Reserve(values * copies)) return state.SkipWithError("device allocation failed");
  Inputs in(context, batch);
  std::vector<sq::SparqCudaArgs> args;
  for (int c = 0; c < copies; ++c) {
    args.push_back({.shape = shape,
                    .config = config,
                    .q = in.q,
                    .k = Store().k + c * values,
                    .v = Store().v + c * values,
                    .kv_begin = in.begin,
                    .kv_len = in.len,
                    .num_seqs = batch,
                    .kv_rows = context * batch,
                    .max_kv_len = context,
                    .v_sum = in.v_sum,
                    .o = in.o});
  }
  const size_t ws_bytes = sq::SparqWorkspaceBytes(args[0]);
  if (cudaMalloc(&in.ws, ws_bytes) != cudaSuccess) return state.SkipWithError("no workspace");
  int64_t it = 0;
  TimeCalls(state,
            [&] { (void)sq::LaunchSparqAttention(args[it++ % copies], in.ws, ws_bytes, nullptr); });
  const sq::SparqBytes b = sq::ModelSparqBytes(shape, config, context, batch);
  SetBytes(state, "paper", b.paper);
  SetBytes(state, "sectors", b.sectors);
  SetBytes(state, "sectors_ws", b.sectors + b.workspace);
  SetBytes(state, "dense", b.dense);
  state.counters["kv_copies"] = copies;
}

void BM_DenseDecode(benchmark::State& state) {
  const int64_t context = state.range(0), batch = state.range(1);
  const size_t values = static_cast<size_t>(context) * batch * kKvHeads * kDim;
  const int copies = Copies(4.0 * values);
  if (!Store().Reserve(values * copies)) return state.SkipWithError("device allocation failed");
  Inputs in(context, batch);
  std::vector<dense::CudaAttentionArgs> args;
  for (int c = 0; c < copies; ++c) {
    args.push_back({.shape = {.num_heads = kHeads,
                              .num_kv_heads = kKvHeads,
                              .head_dim = kDim,
                              .softmax_scale = 1.0f / std::sqrt(float(kDim)),
                              .causal = true},
                    .q = in.q,
                    .q_pos = in.q_pos,
                    .q_tokens = batch,
                    .k = Store().k + c * values,
                    .v = Store().v + c * values,
                    .k_pos = in.k_pos,
                    .kv_tokens = context * batch,
                    .slices = in.slices.data(),
                    .num_slices = batch,
                    .output = dense::OutputMode::kFloat32,
                    .o = in.o,
                    .lse = in.lse});
  }
  const size_t ws_bytes = dense::AttentionWorkspaceBytes(args[0]);
  if (cudaMalloc(&in.ws, ws_bytes + 16) != cudaSuccess) return state.SkipWithError("no workspace");
  int64_t it = 0;
  TimeCalls(state, [&] {
    (void)dense::PartialAttentionCuda(args[it++ % copies], in.ws, ws_bytes, nullptr);
  });
  SetBytes(state, "dense", 4.0 * values);
}

void SparqShapes(benchmark::internal::Benchmark* b) {
  for (int64_t ctx : {8192, 32768, 131072}) {
    for (int64_t batch : {1, 8, 32}) {
      for (int64_t r : {8, 16, 32}) {
        for (int64_t k : {64, 128, 256}) b->Args({ctx, batch, r, k});
      }
    }
  }
  b->ArgNames({"context", "batch", "r", "k"});
}
void DenseShapes(benchmark::internal::Benchmark* b) {
  for (int64_t ctx : {8192, 32768, 131072}) {
    for (int64_t batch : {1, 8, 32}) b->Args({ctx, batch});
  }
  b->ArgNames({"context", "batch"});
}

BENCHMARK(BM_DenseDecode)->Apply(DenseShapes)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Sparq)->Apply(SparqShapes)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace cpfill

BENCHMARK_MAIN();
