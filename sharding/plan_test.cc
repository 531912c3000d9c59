#include "sharding/plan.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill::sharding {
namespace {

// Causal work of a rank for one sequence: every new token at position p sees p + 1 keys.
int64_t CausalWork(const RankSequenceShard& shard) {
  int64_t work = 0;
  for (const PositionRun& run : shard.new_runs) {
    for (int64_t p = run.begin; p < run.end(); ++p) work += p + 1;
  }
  return work;
}

// Every position of [begin, end) appears in exactly one of the runs.
void ExpectCoversOnce(const std::vector<std::vector<PositionRun>>& per_rank, int64_t begin,
                      int64_t end) {
  std::vector<int> hits(end - begin, 0);
  for (const auto& runs : per_rank) {
    for (const PositionRun& run : runs) {
      for (int64_t p = run.begin; p < run.end(); ++p) {
        ASSERT_GE(p, begin);
        ASSERT_LT(p, end);
        ++hits[p - begin];
      }
    }
  }
  for (int64_t i = 0; i < end - begin; ++i) ASSERT_EQ(hits[i], 1) << "position " << begin + i;
}

TEST(ChunkSizes, DifferByAtMostOneAndPairsBalance) {
  for (int n = 1; n <= 8; ++n) {
    for (int64_t t : {0, 1, 2, 7, 16, 17, 100, 1001, 32768}) {
      const std::vector<int64_t> sizes = ChunkSizes(t, n);
      ASSERT_EQ(static_cast<int>(sizes.size()), 2 * n);
      EXPECT_EQ(std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), t);
      const auto [lo, hi] = std::minmax_element(sizes.begin(), sizes.end());
      EXPECT_LE(*hi - *lo, 1);
      for (int r = 0; r < n; ++r) {
        const int64_t held = sizes[r] + sizes[2 * n - 1 - r];
        EXPECT_TRUE(held == t / n || held == (t + n - 1) / n) << "T=" << t << " N=" << n;
      }
    }
  }
}

TEST(PlanPrefill, PaperFigure1RankTakesChunksIAnd2NMinus1MinusI) {
  // CP2, a sequence of 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
  auto plan = PlanPrefill({{.new_tokens = 8}}, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->shard(0, 0).new_runs, (std::vector<PositionRun>{{0, 2}, {6, 2}}));
  EXPECT_EQ(plan->shard(1, 0).new_runs, (std::vector<PositionRun>{{2, 4}}));  // joined run
  EXPECT_EQ(plan->NewTokenPadding(), 0);
}

TEST(PlanPrefill, EveryTokenOnceBalancedWorkAndKv) {
  const std::vector<int64_t> lengths = {0, 1, 3, 17, 1000, 4096, 8191};
  for (int n = 1; n <= 6; ++n) {
    std::vector<SequenceRequest> seqs;
    for (int64_t t : lengths) seqs.push_back({.new_tokens = t});
    auto plan = PlanPrefill(seqs, n);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<int64_t> rank_rows(n, 0);
    int64_t total = 0;
    for (int s = 0; s < plan->num_sequences(); ++s) {
      const int64_t t = lengths[s];
      std::vector<std::vector<PositionRun>> runs;
      std::vector<int64_t> work, kv;
      for (int r = 0; r < n; ++r) {
        runs.push_back(plan->shard(r, s).new_runs);
        work.push_back(CausalWork(plan->shard(r, s)));
        kv.push_back(plan->shard(r, s).kv_tokens());
      }
      ExpectCoversOnce(runs, 0, t);
      const int64_t chunk = (t + 2 * n - 1) / (2 * n);
      // Causal work per rank within one chunk pair (chunk x chunk query-key pairs) of equal.
      // For tiny sequences (chunks of 0 or 1 token) the unit of imbalance is one query row of
      // up to T keys, which is then larger than a chunk pair.
      EXPECT_LE(
          *std::max_element(work.begin(), work.end()) - *std::min_element(work.begin(), work.end()),
          std::max<int64_t>(chunk * chunk, t))
          << "T=" << t << " N=" << n;
      EXPECT_LE(*std::max_element(kv.begin(), kv.end()) - *std::min_element(kv.begin(), kv.end()),
                1);
      for (int r = 0; r < n; ++r) rank_rows[r] += plan->shard(r, s).new_tokens();
      total += t;
    }
    // Pass-Q messages: N of the largest rank's rows; every rank within one row per sequence.
    const int64_t most = *std::max_element(rank_rows.begin(), rank_rows.end());
    EXPECT_EQ(plan->MaxRankNewTokens(), most);
    EXPECT_LE(most - *std::min_element(rank_rows.begin(), rank_rows.end()),
              static_cast<int64_t>(lengths.size()));
    EXPECT_EQ(plan->NewTokenPadding(), most * n - total);
  }
}

TEST(PlanPrefill, NoPaddingWhenLengthsDivide) {
  auto plan = PlanPrefill({{.new_tokens = 32768}, {.new_tokens = 8192}, {.new_tokens = 1024}}, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->NewTokenPadding(), 0);
  EXPECT_EQ(plan->KvPadding(), 0);
}

TEST(PlanPrefill, PartialPrefillShardsOnlyNewTokensAndKeepsTheCache) {
  const int n = 3;
  const std::vector<SequenceRequest> seqs = {{.new_tokens = 100, .cached_tokens = 1000},
                                             {.new_tokens = 7, .cached_tokens = 0},
                                             {.new_tokens = 1, .cached_tokens = 55}};
  auto cache = LayoutOfFullPrefill({1000, 0, 55}, n);
  ASSERT_TRUE(cache.ok());
  auto plan = PlanPrefill(seqs, n, &*cache);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int s = 0; s < 3; ++s) {
    std::vector<std::vector<PositionRun>> new_runs, cached_runs;
    for (int r = 0; r < n; ++r) {
      new_runs.push_back(plan->shard(r, s).new_runs);
      cached_runs.push_back(plan->shard(r, s).cached_runs);
      EXPECT_EQ(plan->shard(r, s).cached_runs, cache->runs[r][s]);  // the cache did not move
    }
    ExpectCoversOnce(new_runs, seqs[s].cached_tokens, seqs[s].cached_tokens + seqs[s].new_tokens);
    ExpectCoversOnce(cached_runs, 0, seqs[s].cached_tokens);
  }
  // A null cache means "laid out by one full prefill".
  auto implicit = PlanPrefill(seqs, n);
  ASSERT_TRUE(implicit.ok());
  for (int r = 0; r < n; ++r) {
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(implicit->shard(r, s).cached_runs, plan->shard(r, s).cached_runs);
    }
  }
}

TEST(PlanPrefill, MultiTurnLayoutsStackAndStayBalanced) {
  const int n = 4;
  KvLayout cache{.cp_size = n,
                 .runs = std::vector<std::vector<std::vector<PositionRun>>>(
                     n, std::vector<std::vector<PositionRun>>(1))};
  int64_t cached = 0;
  for (int64_t turn : {4000, 333, 1, 2048, 17}) {
    auto plan = PlanPrefill({{.new_tokens = turn, .cached_tokens = cached}}, n, &cache);
    ASSERT_TRUE(plan.ok()) << plan.status();
    cache = plan->KvLayoutAfter();
    cached += turn;
    std::vector<std::vector<PositionRun>> runs;
    std::vector<int64_t> held;
    for (int r = 0; r < n; ++r) {
      runs.push_back(cache.runs[r][0]);
      held.push_back(cache.tokens(r, 0));
    }
    ExpectCoversOnce(runs, 0, cached);
    // Each turn adds floor or ceil of T/N per rank, so KV stays within one token per turn.
    EXPECT_LE(
        *std::max_element(held.begin(), held.end()) - *std::min_element(held.begin(), held.end()),
        5);
  }
}

TEST(PlanDecode, RoundRobinWithMovingOffsetFillsRanksEvenly) {
  const int n = 4, batch = 3;
  std::vector<int64_t> lengths(batch, 64);
  auto cache = LayoutOfFullPrefill(lengths, n);
  ASSERT_TRUE(cache.ok());
  KvLayout layout = *cache;
  std::vector<int64_t> decoded(n, 0);
  for (int64_t step = 0; step < 2 * n; ++step) {
    std::vector<SequenceRequest> seqs;
    for (int b = 0; b < batch; ++b) seqs.push_back({.new_tokens = 1, .cached_tokens = lengths[b]});
    auto plan = PlanDecode(seqs, n, step, &layout);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int b = 0; b < batch; ++b) {
      const int owner = static_cast<int>((b + step) % n);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(plan->shard(r, b).new_tokens(), r == owner ? 1 : 0);
      }
      EXPECT_EQ(plan->shard(owner, b).new_runs[0].begin, lengths[b]);
      ++decoded[owner];
      ++lengths[b];
    }
    EXPECT_EQ(plan->MaxRankNewTokens(), 1);  // 3 sequences on 4 ranks: one query each at most
    layout = plan->KvLayoutAfter();
  }
  // 2N steps of 3 sequences: every rank took 6 tokens.
  for (int r = 0; r < n; ++r) EXPECT_EQ(decoded[r], 2 * batch);
}

TEST(MakeLocalLayout, PacksQueriesThenCachedAndNewKeysWithPositions) {
  auto plan = PlanPrefill({{.new_tokens = 8, .cached_tokens = 4}, {.new_tokens = 4}}, 2);
  ASSERT_TRUE(plan.ok());
  const LocalLayout local = MakeLocalLayout(*plan, 0);
  // Seq 0: new [4,12) cut in 4 chunks of 2 -> rank 0 has {4,5} and {10,11}; cached [0,4) cut in 4
  // chunks of 1 -> rank 0 has {0} and {3}.
  EXPECT_EQ(local.q_positions, (std::vector<int32_t>{4, 5, 10, 11, 0, 3}));
  EXPECT_EQ(ExpandPositions(local.kv_runs), (std::vector<int32_t>{0, 3, 4, 5, 10, 11, 0, 3}));
  EXPECT_EQ(local.kv_rows(), 8);
  EXPECT_EQ(local.kv_runs,
            (std::vector<PositionRun>{{0, 1}, {3, 1}, {4, 2}, {10, 2}, {0, 1}, {3, 1}}));
  EXPECT_EQ(local.q_offset, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(local.kv_len, (std::vector<int64_t>{6, 2}));
}

TEST(ShardPlan, KvRunsAfterIsOneEntryOfKvLayoutAfter) {
  auto plan = PlanPrefill({{.new_tokens = 301, .cached_tokens = 900},
                           {.new_tokens = 17, .cached_tokens = 33},
                           {.new_tokens = 5}},
                          3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const KvLayout after = plan->KvLayoutAfter();
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 3; ++s) EXPECT_EQ(plan->KvRunsAfter(r, s), after.runs[r][s]);
  }
}

// A slice's local rows are the matching contiguous slice of the whole plan's, on every rank:
// what lets a mixed batch run each algorithm's sequences as their own ring without copies.
TEST(ShardPlan, SliceIsAContiguousSliceOfEveryRanksRows) {
  auto plan = PlanPrefill({{.new_tokens = 301, .cached_tokens = 900},
                           {.new_tokens = 17, .cached_tokens = 33},
                           {.new_tokens = 5},
                           {.new_tokens = 64, .cached_tokens = 7}},
                          3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const ShardPlan mid = plan->Slice(1, 2);
  ASSERT_EQ(mid.num_sequences(), 2);
  EXPECT_EQ(mid.sequences[0].cached_tokens, 33);
  for (int r = 0; r < 3; ++r) {
    const LocalLayout all = MakeLocalLayout(*plan, r), part = MakeLocalLayout(mid, r);
    const int64_t q0 = all.q_offset[1], kv0 = all.kv_offset[1];
    ASSERT_EQ(part.q_rows(), all.q_offset[3] - q0) << r;
    ASSERT_EQ(part.kv_rows(), all.kv_offset[3] - kv0) << r;
    EXPECT_TRUE(
        std::equal(part.q_positions.begin(), part.q_positions.end(), all.q_positions.begin() + q0))
        << r;
    const std::vector<int32_t> part_kv = ExpandPositions(part.kv_runs),
                               all_kv = ExpandPositions(all.kv_runs);
    EXPECT_TRUE(std::equal(part_kv.begin(), part_kv.end(), all_kv.begin() + kv0)) << r;
  }
}

// Planning must stay near-linear in the number of sequences: a batch of 100,000 one-token
// prompts on CP4 (a per-sequence scan inside a per-sequence loop would take minutes). The
// bound is generous on purpose; bench/plan_bench.cc measures the real cost.
TEST(PlanPrefill, HundredThousandOneTokenPromptsPlanQuickly) {
  constexpr int kSeqs = 100000, kCp = 4;
  const auto start = std::chrono::steady_clock::now();
  auto plan = PlanPrefill(std::vector<SequenceRequest>(kSeqs, {.new_tokens = 1}), kCp);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<LocalLayout> locals;
  for (int r = 0; r < kCp; ++r) locals.push_back(MakeLocalLayout(*plan, r));
  const KvLayout after = plan->KvLayoutAfter();
  auto next = PlanPrefill(
      std::vector<SequenceRequest>(kSeqs, {.new_tokens = 1, .cached_tokens = 1}), kCp, &after);
  ASSERT_TRUE(next.ok()) << next.status();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  // One token goes to chunk 0, i.e. CP rank 0, for every sequence.
  EXPECT_EQ(locals[0].q_rows(), kSeqs);
  for (int r = 1; r < kCp; ++r) EXPECT_EQ(locals[r].q_rows(), 0);
  EXPECT_EQ(locals[0].q_positions[kSeqs - 1], 0);
  EXPECT_EQ(next->shard(0, kSeqs - 1).cached_runs, (std::vector<PositionRun>{{0, 1}}));
  EXPECT_EQ(next->shard(0, kSeqs - 1).new_runs, (std::vector<PositionRun>{{1, 1}}));
}

TEST(PlanPrefill, RejectsBadInput) {
  EXPECT_EQ(PlanPrefill({{.new_tokens = -1}}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPrefill({{.new_tokens = 1, .cached_tokens = -5}}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPrefill({{.new_tokens = 1}}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto cache = LayoutOfFullPrefill({10}, 2);
  ASSERT_TRUE(cache.ok());
  // Cache holds 10 tokens, request claims 12.
  auto bad = PlanPrefill({{.new_tokens = 1, .cached_tokens = 12}}, 2, &*cache);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("cached"), std::string::npos) << bad.status();
  // Cache for another CP size.
  EXPECT_FALSE(PlanPrefill({{.new_tokens = 1, .cached_tokens = 10}}, 3, &*cache).ok());
  // A position held twice.
  KvLayout twice = *cache;
  twice.runs[1][0].push_back({0, 1});
  EXPECT_FALSE(PlanPrefill({{.new_tokens = 1, .cached_tokens = 10}}, 2, &twice).ok());
  EXPECT_FALSE(PlanDecode({{.new_tokens = 2}}, 2, 0).ok());
}

}  // namespace
}  // namespace cpfill::sharding
