#include "parallel/ring_plan.h"

#include <chrono>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/mixed_ring.h"

namespace cpfill::parallel {
namespace {

// Positions of the keys `source` holds of every sequence, laid out as a pass-KV message.
std::vector<int32_t> KvMessagePositions(const RingPlan& rp, const sharding::ShardPlan& plan,
                                        int source) {
  const sharding::LocalLayout src = sharding::MakeLocalLayout(plan, source);
  const std::vector<int32_t> src_positions = sharding::ExpandPositions(src.kv_runs);
  std::vector<int32_t> pos(rp.kv_slots_total(), attention::kPadPosition);
  for (int s = 0; s < plan.num_sequences(); ++s) {
    for (int64_t i = 0; i < src.kv_len[s]; ++i) {
      pos[rp.kv_slot_offset(s) + i] = src_positions[src.kv_offset[s] + i];
    }
  }
  return pos;
}

TEST(RingPlan, ClosedFormPairsEqualCountingOnPositions) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + trial % 5;
    std::vector<sharding::SequenceRequest> seqs;
    for (int s = 0; s < 1 + trial % 4; ++s) {
      seqs.push_back({.new_tokens = static_cast<int64_t>(rng() % 300),
                      .cached_tokens = static_cast<int64_t>(trial % 3 == 0 ? rng() % 500 : 0)});
    }
    auto plan = sharding::PlanPrefill(seqs, n);
    ASSERT_TRUE(plan.ok());
    for (bool causal : {true, false}) {
      attention::AttentionShape shape{
          .num_heads = 1, .num_kv_heads = 1, .head_dim = 1, .softmax_scale = 1, .causal = causal};
      for (int me = 0; me < n; ++me) {
        RingPlan rp(*plan, me, causal);
        for (int source = 0; source < n; ++source) {
          RingStepTiming step;
          std::vector<attention::SequenceSlice> slices;
          rp.PassKvSlices(source, &slices, &step);
          const std::vector<int32_t> kpos = KvMessagePositions(rp, *plan, source);
          const std::vector<float> dummy(1);
          attention::AttentionParams p{.shape = shape,
                                       .q = dummy.data(),
                                       .q_pos = rp.layout().q_positions.data(),
                                       .q_tokens = rp.layout().q_rows(),
                                       .k = dummy.data(),
                                       .v = dummy.data(),
                                       .k_pos = kpos.data(),
                                       .kv_tokens = rp.kv_slots_total(),
                                       .slices = slices.data(),
                                       .num_slices = static_cast<int64_t>(slices.size()),
                                       .o = nullptr,
                                       .lse = nullptr};
          // Rows are not written by CountVisiblePairs; o/lse may be null only without rows.
          std::vector<float> o(rp.layout().q_rows() + 1), lse(rp.layout().q_rows() + 1);
          p.o = o.data();
          p.lse = lse.data();
          EXPECT_EQ(step.visible_pairs, attention::CountVisiblePairs(p))
              << "trial " << trial << " rank " << me << " source " << source;
          EXPECT_LE(step.chunk_pairs_hidden, step.chunk_pairs);
        }
      }
    }
  }
}

// Every rank's ring plan and every step's slices for 100,000 one-token prompts on CP4 stay
// near-linear in the batch (generous bound; bench/plan_bench.cc measures the real cost).
TEST(RingPlan, HundredThousandOneTokenPromptsPlanQuickly) {
  constexpr int kSeqs = 100000, kCp = 4;
  const auto start = std::chrono::steady_clock::now();
  auto plan =
      sharding::PlanPrefill(std::vector<sharding::SequenceRequest>(kSeqs, {.new_tokens = 1}), kCp);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int64_t kv_pairs = 0, q_pairs = 0, kv_slices = 0, q_slices = 0, gathered = 0;
  std::vector<attention::SequenceSlice> slices;
  for (int me = 0; me < kCp; ++me) {
    RingPlan rp(*plan, me, /*causal=*/true);
    for (int source = 0; source < kCp; ++source) {
      RingStepTiming kv_step, q_step;
      rp.PassKvSlices(source, &slices, &kv_step);
      kv_slices += static_cast<int64_t>(slices.size());
      rp.PassQSlices(source, &slices, &q_step);
      q_slices += static_cast<int64_t>(slices.size());
      kv_pairs += kv_step.visible_pairs;
      q_pairs += q_step.visible_pairs;
    }
    gathered += rp.AllGatherVisiblePairs();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  // Each prompt's one token (on CP rank 0) sees itself only: one pair and one slice per prompt
  // over the whole ring, under every algorithm.
  EXPECT_EQ(kv_pairs, kSeqs);
  EXPECT_EQ(q_pairs, kSeqs);
  EXPECT_EQ(gathered, kSeqs);
  EXPECT_EQ(kv_slices, kSeqs);
  EXPECT_EQ(q_slices, kSeqs);
}

// A source's queries of sequences with no key on this rank are named (real rows, not padding),
// so that prefix batching's roots do not span them: one-token prompts live on CP rank 0.
TEST(RingPlan, PassQNamesQueriesWithoutKeysHere) {
  auto plan =
      sharding::PlanPrefill(std::vector<sharding::SequenceRequest>(3, {.new_tokens = 1}), 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<attention::SequenceSlice> slices, keyless;
  RingStepTiming step;
  const RingPlan owner(*plan, 0, /*causal=*/true), other(*plan, 1, /*causal=*/true);
  owner.PassQSlices(0, &slices, &step, &keyless);
  EXPECT_EQ(slices.size(), 3u);
  EXPECT_TRUE(keyless.empty());
  other.PassQSlices(0, &slices, &step, &keyless);
  EXPECT_TRUE(slices.empty());
  ASSERT_EQ(keyless.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(keyless[i].q_begin, i);  // rank 0's queries, unpadded
    EXPECT_EQ(keyless[i].q_len, 1);
  }
  other.PassQSlices(1, &slices, &step, &keyless);  // rank 1 holds none of their queries
  EXPECT_TRUE(keyless.empty());
}

// A decode step's pass-Q message holds its source's queries only: B/N slots, not B, and the
// source's sequences side by side (no other rank's padding between them), on every receiver.
TEST(RingPlan, PassQDecodeMessagesHoldTheSourcesQueriesOnly) {
  constexpr int kRanks = 4, kBatch = 8;
  std::vector<sharding::SequenceRequest> seqs(kBatch, {.new_tokens = 1, .cached_tokens = 64});
  auto plan = sharding::PlanDecode(seqs, kRanks, /*step=*/1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int me = 0; me < kRanks; ++me) {
    const RingPlan ring(*plan, me, /*causal=*/true);
    EXPECT_EQ(ring.q_message_slots(), kBatch / kRanks);
    for (int source = 0; source < kRanks; ++source) {
      EXPECT_EQ(ring.source_q_rows(source), kBatch / kRanks);
      std::vector<attention::SequenceSlice> slices;
      RingStepTiming step;
      ring.PassQSlices(source, &slices, &step);
      ASSERT_EQ(slices.size(), static_cast<size_t>(kBatch / kRanks));
      for (size_t i = 0; i < slices.size(); ++i) {
        EXPECT_EQ(slices[i].q_begin, static_cast<int64_t>(i));
        EXPECT_EQ(slices[i].q_len, 1);
      }
    }
  }
}

// A mixed batch's rings: one per run of adjacent sequences with one algorithm; GroupOrder puts
// each algorithm's sequences side by side (stable), so two algorithms make two rings.
TEST(MixedRing, RunsAndGroupOrder) {
  constexpr RingAlgorithm KV = RingAlgorithm::kPassKV, Q = RingAlgorithm::kPassQ;
  const std::vector<RingAlgorithm> mixed = {Q, KV, KV, Q, KV};
  const std::vector<AlgorithmRun> runs = AlgorithmRuns(mixed);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[1].algorithm, KV);
  EXPECT_EQ(runs[1].first, 1);
  EXPECT_EQ(runs[1].count, 2);
  EXPECT_EQ(AlgorithmsName(mixed), "pass-q,pass-kv,pass-kv,pass-q,pass-kv");
  EXPECT_EQ(AlgorithmsName(std::vector<RingAlgorithm>(3, Q)), "pass-q");

  const std::vector<int> order = GroupOrder(mixed);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 4, 0, 3}));
  std::vector<RingAlgorithm> grouped;
  for (int i : order) grouped.push_back(mixed[i]);
  EXPECT_EQ(AlgorithmRuns(grouped).size(), 2u);
  EXPECT_TRUE(AlgorithmRuns({}).empty());
}

}  // namespace
}  // namespace cpfill::parallel
