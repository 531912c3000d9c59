#include "runtime/plan/cost_model.h"

#include <cmath>

#include "gtest/gtest.h"
#include "parallel/ring_plan.h"
#include "runtime/model/memory.h"

namespace cpfill::runtime::plan {
namespace {

using parallel::RingAlgorithm;

DeviceProfile FlatDevice(double tflops, double elem_bytes = 4) {
  DeviceProfile d;
  d.elem_bytes = elem_bytes;
  d.attention = {{1, tflops}};
  d.gemm = {{1, tflops}};
  return d;
}

Link FastLink() { return {.name = "fast", .gbps = 1e9}; }

// The model's per-step work and bytes are the ring's own (parallel/ring_plan.h), step by step and
// rank by rank, on uneven batches, partial prefills and both algorithms.
TEST(PredictRing, StepWorkAndBytesEqualTheRingPlans) {
  const AttentionGeometry g{.heads = 4, .kv_heads = 1, .head_dim = 64};
  const std::vector<std::vector<sharding::SequenceRequest>> batches = {
      {{.new_tokens = 1000}},
      {{.new_tokens = 4099},
       {.new_tokens = 1031, .cached_tokens = 9000},
       {.new_tokens = 17, .cached_tokens = 3}},
      {{.new_tokens = 301, .cached_tokens = 9000}, {.new_tokens = 5}}};
  for (const auto& batch : batches) {
    for (int n : {1, 2, 3, 4}) {
      auto plan = sharding::PlanPrefill(batch, n);
      ASSERT_TRUE(plan.ok());
      for (RingAlgorithm a : {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ}) {
        auto cost = PredictRing(*plan, a, g, 4, FlatDevice(1), FastLink());
        ASSERT_TRUE(cost.ok());
        for (int k = 0; k < n; ++k) {
          parallel::RingPlan rp(*plan, k, /*causal=*/true);
          for (int j = 0; j < n; ++j) {
            const RingStepCost& s = cost->ranks[k].steps[j];
            parallel::RingStepTiming want;
            std::vector<attention::SequenceSlice> slices;
            if (n == 1) {
              rp.LocalSlices(&slices, &want);
            } else if (a == RingAlgorithm::kPassKV) {
              rp.PassKvSlices(s.source_cp_rank, &slices, &want);
            } else {
              rp.PassQSlices(s.source_cp_rank, &slices, &want);
            }
            EXPECT_EQ(s.visible_pairs, want.visible_pairs)
                << "N " << n << " rank " << k << " step " << j;
            EXPECT_EQ(s.chunk_pairs, want.chunk_pairs);
            EXPECT_EQ(s.chunk_pairs_hidden, want.chunk_pairs_hidden);
            const parallel::MessageLayout m =
                a == RingAlgorithm::kPassKV
                    ? parallel::MessageLayout::Make(rp.kv_slots_total(), 64 * 4, 64 * 4)
                    : parallel::MessageLayout::Make(rp.q_message_slots(), 4 * 64 * 4, 0);
            EXPECT_EQ(s.exchange_bytes, j + 1 < n ? static_cast<int64_t>(m.bytes) : 0);
          }
        }
      }
    }
  }
}

TEST(PredictRing, EveryVisiblePairIsComputedOnceAndLoadIsBalanced) {
  const int64_t t = 131072;
  auto plan = sharding::PlanPrefill({{.new_tokens = t}}, 4);
  ASSERT_TRUE(plan.ok());
  auto cost = PredictRing(*plan, RingAlgorithm::kPassKV, {.heads = 1, .kv_heads = 1}, 2,
                          FlatDevice(100), FastLink());
  ASSERT_TRUE(cost.ok());
  int64_t total = 0;
  std::vector<int64_t> per_rank;
  for (const RankRingCost& r : cost->ranks) {
    int64_t mine = 0;
    for (const RingStepCost& s : r.steps) mine += s.visible_pairs;
    per_rank.push_back(mine);
    total += mine;
  }
  EXPECT_EQ(total, t * (t + 1) / 2);
  // 2N-chunk sharding: every rank does the same causal work, to a few chunks' rounding.
  for (int64_t mine : per_rank) EXPECT_NEAR(double(mine) / per_rank[0], 1.0, 1e-3);
}

TEST(PredictRing, ExposedWaitIsTransferMinusComputeOnASlowLink) {
  auto plan = sharding::PlanPrefill({{.new_tokens = 4096}}, 2);
  ASSERT_TRUE(plan.ok());
  const AttentionGeometry g{.heads = 16, .kv_heads = 1, .head_dim = 128};
  const Link slow{.name = "slow", .gbps = 0.001};
  auto cost = PredictRing(*plan, RingAlgorithm::kPassKV, g, 2, FlatDevice(1), slow);
  ASSERT_TRUE(cost.ok());
  const RingStepCost& s0 = cost->ranks[0].steps[0];
  EXPECT_GT(s0.transfer_s, s0.compute_s);
  EXPECT_NEAR(s0.wait_s, s0.transfer_s - s0.compute_s, 1e-12);
  const double last = cost->ranks[0].steps[1].compute_s;
  EXPECT_NEAR(cost->ranks[0].total_s, s0.transfer_s + last, 1e-12);
  // On a fast link nothing waits and the ring is the sum of its computes.
  auto fast = PredictRing(*plan, RingAlgorithm::kPassKV, g, 2, FlatDevice(1), FastLink());
  ASSERT_TRUE(fast.ok());
  EXPECT_LT(fast->ranks[0].steps[0].wait_s, 1e-9);
}

TEST(PredictRing, PassQPaysAllToAllOfFp32Partials) {
  auto plan = sharding::PlanPrefill({{.new_tokens = 400, .cached_tokens = 10000}}, 4);
  ASSERT_TRUE(plan.ok());
  const AttentionGeometry g{.heads = 8, .kv_heads = 1, .head_dim = 128};
  auto cost =
      PredictRing(*plan, RingAlgorithm::kPassQ, g, 2, FlatDevice(10), {.name = "l", .gbps = 1});
  ASSERT_TRUE(cost.ok());
  // Each rank holds 100 of the 400 new tokens and sends the 300 others' partials: O and LSE.
  EXPECT_EQ(cost->ranks[0].all_to_all_bytes, 300 * 4 * (8 * 128 + 8));
  EXPECT_GT(cost->ranks[0].all_to_all_s, 0);
}

PlanInput Llama405b(int nodes, int tp) {
  auto c = LoadModelConfig("llama3-405b");
  EXPECT_TRUE(c.ok());
  return {.model = PlanModelOf(*c),
          .requests = {{.new_tokens = 131072}},
          .gpus_per_node = 8,
          .nodes = nodes,
          .tp = tp,
          .cp = 8 * nodes / tp};
}

LinkProfile Links() {
  return {.links = {{.name = "nvlink", .gbps = 150, .latency_us = 5},
                    {.name = "roce", .gbps = 50, .latency_us = 10}},
          .intra_node = "nvlink",
          .inter_node = "roce"};
}

TEST(PredictPrefill, ScalesWithNodesAndBreaksDownPerLayer) {
  DeviceProfile d = FlatDevice(500, 2);
  d.memory_gbps = 3000;
  auto one = PredictPrefill(Llama405b(1, 8), d, Links());
  auto four = PredictPrefill(Llama405b(4, 8), d, Links());
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->ring_link, "roce");
  EXPECT_EQ(one->tp_link, "nvlink");
  const double speedup = one->ttft_s / four->ttft_s;
  EXPECT_GT(speedup, 3.5);
  EXPECT_LE(speedup, 4.05);
  EXPECT_NEAR(four->ttft_s, 126 * four->layer.total_s() + four->lm_head_s, 1e-9);
  EXPECT_GT(four->layer.all_reduce_s, 0);
  EXPECT_GT(four->decode_step_s, 0);
  EXPECT_EQ(four->algorithms[0], RingAlgorithm::kPassKV);  // full prefill: pass-KV
}

TEST(PredictPrefill, RefusesGridsThatDoNotCoverTheGpusOrSplitTheHeads) {
  DeviceProfile d = FlatDevice(500, 2);
  PlanInput bad = Llama405b(2, 8);
  bad.cp = 3;
  auto p = PredictPrefill(bad, d, Links());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("--tp"), std::string::npos);
  bad = Llama405b(2, 16);  // 8 KV heads do not split over 16
  EXPECT_FALSE(PredictPrefill(bad, d, Links()).ok());
  DeviceProfile no_gemm = d;
  no_gemm.gemm.clear();
  EXPECT_FALSE(PredictPrefill(Llama405b(1, 8), no_gemm, Links()).ok());
}

TEST(PredictPrefill, MemoryUsesTheProjectsPlannerAndSaysWhenItDoesNotFit) {
  DeviceProfile d = FlatDevice(500, 2);
  d.device_memory_bytes = 80e9;
  auto tp8 = PredictPrefill(Llama405b(1, 8), d, Links());
  ASSERT_TRUE(tp8.ok());
  // bf16 405B on TP8 is about 101 GB per GPU: does not fit 80 GB (the paper runs FP8).
  EXPECT_EQ(tp8->memory.weight_bytes, HostWeightBytes(*tp8->input.model.config, 8) / 2);
  EXPECT_FALSE(tp8->memory.fits);
  EXPECT_NE(tp8->memory.verdict.find("need"), std::string::npos);
}

TEST(SearchGrids, RanksEveryGridThatSplitsTheHeads) {
  DeviceProfile d = FlatDevice(500, 2);
  PlanInput in = Llama405b(2, 8);
  auto all = SearchGrids(in, d, Links());
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 4u);  // TP1, 2, 4, 8 (8 KV heads)
  for (size_t i = 1; i < all->size(); ++i) EXPECT_LE((*all)[i - 1].ttft_s, (*all)[i].ttft_s);
}

TEST(PredictPrefill, MixedBatchRunsOneRingPerAlgorithm) {
  PlanInput in{.model = {.heads = 16, .kv_heads = 1, .head_dim = 128, .name = "attention"},
               .requests = {{.new_tokens = 32768}, {.new_tokens = 128, .cached_tokens = 100000}},
               .gpus_per_node = 4,
               .nodes = 1,
               .tp = 1,
               .cp = 4};
  LinkProfile links{
      .links = {{.name = "sockets", .gbps = 3}}, .intra_node = "sockets", .inter_node = "sockets"};
  auto p = PredictPrefill(in, FlatDevice(300, 2), links);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->rings.size(), 2u);
  EXPECT_EQ(p->algorithms[0], RingAlgorithm::kPassKV);
  EXPECT_EQ(p->algorithms[1], RingAlgorithm::kPassQ);
  EXPECT_NEAR(p->ttft_s, p->rings[0].total_s + p->rings[1].total_s, 1e-12);
}

}  // namespace
}  // namespace cpfill::runtime::plan
