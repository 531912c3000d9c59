// Planning cost of a fused batch on the host: PlanPrefill, every rank's MakeLocalLayout and
// RingPlan, every step's pass-KV and pass-Q slices, the all-gather pair count and the next turn's
// KvLayoutAfter, for 1K, 10K and 100K one-token prompts on CP4 (the shape where a per-sequence
// scan inside a per-sequence loop shows), for 1K and 10K prompts of 1000 tokens (linear in
// tokens: the local layouts list every query position), the model's PlanBatch with a session per
// prompt (SessionAfter for every one, as LlamaModel::Commit does), and a decode step of many
// sessions after long prompts (linear in sequences, not in their cached tokens).
//
//   build/bench/plan_bench --benchmark_filter=OneToken
//   build/bench/plan_bench --benchmark_format=json > results.json

#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "parallel/ring_plan.h"
#include "runtime/model/prefill_batch.h"
#include "sharding/plan.h"

namespace cpfill {
namespace {

constexpr int kCpSize = 4;

// Everything the ring asks of the plan on every rank, as one CP group plans one batch.
void PlanEverything(const std::vector<sharding::SequenceRequest>& seqs, benchmark::State& state) {
  auto plan = sharding::PlanPrefill(seqs, kCpSize);
  if (!plan.ok()) {
    state.SkipWithError(plan.status().ToString().c_str());
    return;
  }
  std::vector<attention::SequenceSlice> slices;
  for (int cp_rank = 0; cp_rank < kCpSize; ++cp_rank) {
    parallel::RingPlan rp(*plan, cp_rank, /*causal=*/true);
    for (int source = 0; source < kCpSize; ++source) {
      parallel::RingStepTiming step;
      rp.PassKvSlices(source, &slices, &step);
      rp.PassQSlices(source, &slices, &step);
      benchmark::DoNotOptimize(step.visible_pairs);
    }
    benchmark::DoNotOptimize(rp.AllGatherVisiblePairs());
  }
  benchmark::DoNotOptimize(plan->KvLayoutAfter());
}

void BM_PlanOneTokenPrompts(benchmark::State& state) {
  const std::vector<sharding::SequenceRequest> seqs(state.range(0), {.new_tokens = 1});
  for (auto _ : state) PlanEverything(seqs, state);
  state.SetItemsProcessed(state.iterations() * state.range(0));  // sequences per second
}
BENCHMARK(BM_PlanOneTokenPrompts)
    ->Arg(1000)
    ->Arg(10000)
    ->Arg(100000)
    ->Unit(benchmark::kMillisecond);

void BM_PlanThousandTokenPrompts(benchmark::State& state) {
  const std::vector<sharding::SequenceRequest> seqs(state.range(0), {.new_tokens = 1000});
  for (auto _ : state) PlanEverything(seqs, state);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_PlanThousandTokenPrompts)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);

// The model's planning around its layers (runtime/model/prefill_batch.h) for one-token prompts that
// each open a session: PlanBatch on CP rank 0 of 4, the last-position rows, and every session's
// layout after the batch (what LlamaModel::Commit asks for).
void BM_PlanBatchOneTokenSessions(benchmark::State& state) {
  auto config = runtime::LoadModelConfig("tiny");
  std::vector<runtime::PrefillRequest> batch(state.range(0));
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i] = {.tokens = {static_cast<int32_t>(i % 1000)}, .session = "s" + std::to_string(i)};
  }
  for (auto _ : state) {
    auto b = runtime::PlanBatch(
        *config, batch, kCpSize, /*cp_rank=*/0,
        [](const std::string&) -> const runtime::SessionLayout* { return nullptr; });
    if (!b.ok()) {
      state.SkipWithError(b.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(runtime::LastPositionRows(*b));
    for (int s = 0; s < b->plan.num_sequences(); ++s) {
      benchmark::DoNotOptimize(runtime::SessionAfter(*b, s));
    }
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_PlanBatchOneTokenSessions)
    ->Arg(1000)
    ->Arg(10000)
    ->Arg(100000)
    ->Unit(benchmark::kMillisecond);

// A decode step's host planning (LlamaModel::Step before its layers) for `range(0)` sequences
// that each hold a `range(1)`-token session on CP `range(2)`: PlanBatch (which lays out every
// cached key of this rank) and the ring's plan (RingPlan, as MixedRing::Create builds it).
// Forks of one prompt decoding together list every cached key position of every fork.
void BM_PlanDecodeStep(benchmark::State& state) {
  auto config = runtime::LoadModelConfig("tiny");
  config->max_position_embeddings = 1 << 20;
  const int n = static_cast<int>(state.range(0)), cp = static_cast<int>(state.range(2));
  auto cached = sharding::LayoutOfFullPrefill({state.range(1)}, cp);
  if (!cached.ok()) return state.SkipWithError(cached.status().ToString().c_str());
  const runtime::SessionLayout session{.tokens = state.range(1), .layout = *cached};
  std::vector<runtime::PrefillRequest> batch(n);
  for (int i = 0; i < n; ++i) batch[i] = {.tokens = {i % 100}, .session = "s" + std::to_string(i)};
  for (auto _ : state) {
    auto b = runtime::PlanBatch(
        *config, batch, cp, /*cp_rank=*/0,
        [&](const std::string&) -> const runtime::SessionLayout* { return &session; },
        /*decode_step=*/7);
    if (!b.ok()) return state.SkipWithError(b.status().ToString().c_str());
    parallel::RingPlan ring(b->plan, /*cp_rank=*/0, /*causal=*/true);
    benchmark::DoNotOptimize(ring.layout().kv_rows());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_PlanDecodeStep)
    ->Args({256, 16384, 1})
    ->Args({256, 16384, 2})
    ->Args({64, 16384, 1})
    ->Args({8, 131072, 1})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace cpfill

BENCHMARK_MAIN();
