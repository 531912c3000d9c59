// PartialAttentionCpu against the naive fp64 reference: GFLOP/s on causal prefill shapes.
//
// FLOPs count only what the mask leaves visible: 4 * head_dim * num_heads * CountVisiblePairs
// (two multiply-adds per element of QK^T and of PV). Counters are rates over wall time, shown
// as GFLOP=<GFLOP/s> and GFLOP_per_thread=<GFLOP/s per thread>.
//
//   build-attn/bench/attention_cpu_bench --benchmark_filter=Cpu
//   build-attn/bench/attention_cpu_bench --benchmark_format=json > results.json

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention/attention.h"
#include "attention/reference.h"
#include "base/random.h"
#include "base/thread_pool.h"
#include "benchmark/benchmark.h"

namespace cpfill::attention {
namespace {

// One causal prefill of `tokens` tokens: every query attends to the keys at or before it.
struct Prefill {
  AttentionShape shape;
  std::vector<float> q, k, v, o, lse;
  std::vector<int32_t> pos;
  SequenceSlice slice;
  AttentionParams params;

  Prefill(int num_heads, int num_kv_heads, int head_dim, int64_t tokens) {
    shape = AttentionShape{.num_heads = num_heads,
                           .num_kv_heads = num_kv_heads,
                           .head_dim = head_dim,
                           .softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim)),
                           .causal = true};
    q.resize(tokens * num_heads * head_dim);
    k.resize(tokens * num_kv_heads * head_dim);
    v.resize(k.size());
    o.resize(q.size());
    lse.resize(tokens * num_heads);
    pos.resize(tokens);
    for (size_t i = 0; i < q.size(); ++i) q[i] = UniformAt(1, 1, i);
    for (size_t i = 0; i < k.size(); ++i) k[i] = UniformAt(1, 2, i);
    for (size_t i = 0; i < v.size(); ++i) v[i] = UniformAt(1, 3, i);
    for (int64_t i = 0; i < tokens; ++i) pos[i] = static_cast<int32_t>(i);
    slice = SequenceSlice{0, tokens, 0, tokens};
    params = AttentionParams{.shape = shape,
                             .q = q.data(),
                             .q_pos = pos.data(),
                             .q_tokens = tokens,
                             .k = k.data(),
                             .v = v.data(),
                             .k_pos = pos.data(),
                             .kv_tokens = tokens,
                             .slices = &slice,
                             .num_slices = 1,
                             .o = o.data(),
                             .lse = lse.data()};
  }

  double Flops() const {
    return 4.0 * shape.head_dim * shape.num_heads * static_cast<double>(CountVisiblePairs(params));
  }
};

void SetCounters(benchmark::State& state, double flops, int threads) {
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_thread"] =
      benchmark::Counter(flops * 1e-9 / threads, benchmark::Counter::kIsIterationInvariantRate);
}

// Args: num_heads, num_kv_heads, head_dim, tokens, threads.
void BM_PartialAttentionCpu(benchmark::State& state) {
  Prefill pf(state.range(0), state.range(1), state.range(2), state.range(3));
  const int threads = static_cast<int>(state.range(4));
  ThreadPool pool(threads);
  for (auto _ : state) {
    const absl::Status s = PartialAttentionCpu(pf.params, &pool);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(pf.o.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, pf.Flops(), threads);
}

// The reference is single-threaded; the thread argument is kept for a like-for-like table.
void BM_ReferenceFp64(benchmark::State& state) {
  Prefill pf(state.range(0), state.range(1), state.range(2), state.range(3));
  std::vector<double> o, lse;
  for (auto _ : state) {
    ReferenceAttention(pf.params, &o, &lse);
    benchmark::DoNotOptimize(o.data());
  }
  SetCounters(state, pf.Flops(), 1);
}

void KernelShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"heads", "kv_heads", "dim", "tokens", "threads"});
  for (int threads : {1, 2}) {
    for (int tokens : {1024, 2048, 4096}) b->Args({16, 1, 128, tokens, threads});
    for (int tokens : {1024, 2048}) b->Args({32, 8, 128, tokens, threads});
  }
}

BENCHMARK(BM_PartialAttentionCpu)
    ->Apply(KernelShapes)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ReferenceFp64)
    ->ArgNames({"heads", "kv_heads", "dim", "tokens", "threads"})
    ->Args({16, 1, 128, 1024, 1})
    ->Args({16, 1, 128, 2048, 1})
    ->Args({32, 8, 128, 1024, 1})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->UseRealTime();

}  // namespace
}  // namespace cpfill::attention

BENCHMARK_MAIN();
