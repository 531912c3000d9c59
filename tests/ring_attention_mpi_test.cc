// Multi-rank tests of ring attention: every algorithm, and batches whose sequences each run their
// own (MixedRing), full and partial prefill, uneven fused batches (lengths that do not divide by
// 2N, empty and one-token sequences), GQA, TP x CP grids. Each distributed result is gathered on
// world rank 0 and compared with a single-rank computation of the same batch. Run by CTest under
// mpirun with 2, 3 and 4 ranks.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention/attention.h"
#include "gtest/gtest.h"
#include "launch/job/synthetic_attention.h"
#include "parallel/gather_outputs.h"
#include "parallel/grid.h"
#include "parallel/mixed_ring.h"
#include "parallel/ring_attention.h"
#include "sharding/plan.h"
#include "tests/mpi_test_main.h"

namespace cpfill {
namespace {

using parallel::RingAlgorithm;
using sharding::SequenceRequest;

struct Case {
  std::string name;
  std::vector<SequenceRequest> sequences;
  int heads = 4, kv_heads = 2, head_dim = 32;
  bool causal = true;
  // Earlier turns that built the cache, per sequence (their sum is the cached length); empty:
  // the cache was one full prefill.
  std::vector<std::vector<int64_t>> turns;
};

// How a run is made: timed with a host wait (the default), enqueued with one Finish() after
// it, or enqueued reading this rank's K/V in place from shuffled KV-cache blocks (pass-Q).
enum class Variant { kWait, kEnqueue, kPagedEnqueue };

constexpr int kBlockTokens = 16;

// This rank's K/V as a KV cache holds them: each sequence's local rows in shuffled blocks of
// kBlockTokens rows, NaN in every row no sequence holds.
struct HostPool {
  std::vector<float> k, v;
  std::vector<int32_t> table;
  std::vector<int64_t> kv_begin, table_begin;
  attention::PagedKv View(int64_t row_floats) const {
    return {.table = table.data(),
            .block_tokens = kBlockTokens,
            .block_stride_bytes = kBlockTokens * row_floats * int64_t{sizeof(float)},
            .seq_kv_begin = kv_begin,
            .seq_table_begin = table_begin};
  }
};

HostPool PoolOf(const sharding::LocalLayout& layout, const std::vector<float>& k,
                const std::vector<float>& v, int64_t row_floats) {
  HostPool pool;
  int64_t blocks = 2;  // spare blocks nobody holds
  for (size_t s = 0; s < layout.kv_len.size(); ++s) {
    blocks += (layout.kv_len[s] + kBlockTokens - 1) / kBlockTokens;
  }
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(blocks));
  pool.k.assign(blocks * kBlockTokens * row_floats, std::nanf(""));
  pool.v.assign(pool.k.size(), std::nanf(""));
  size_t next = 0;
  for (size_t s = 0; s < layout.kv_len.size(); ++s) {
    if (layout.kv_len[s] == 0) continue;
    pool.kv_begin.push_back(layout.kv_offset[s]);
    pool.table_begin.push_back(static_cast<int64_t>(pool.table.size()));
    for (int64_t r = 0; r < layout.kv_len[s]; ++r) {
      if (r % kBlockTokens == 0) pool.table.push_back(ids[next++]);
      const int64_t dst =
          (int64_t{pool.table.back()} * kBlockTokens + r % kBlockTokens) * row_floats;
      const int64_t src = (layout.kv_offset[s] + r) * row_floats;
      std::copy_n(k.begin() + src, row_floats, pool.k.begin() + dst);
      std::copy_n(v.begin() + src, row_floats, pool.v.begin() + dst);
    }
  }
  return pool;
}

// Runs each sequence on its algorithm (parallel::MixedRing: one ring per run of adjacent equal
// ones) and compares with one rank. Returns "" when equal within tolerance, else what differed
// (on world rank 0; other ranks return "").
std::string RunAndCompare(parallel::ProcessGrid& grid, const Case& c,
                          const std::vector<RingAlgorithm>& algos, parallel::CpuRingOps& ops,
                          Variant variant = Variant::kWait) {
  auto fail = [](const absl::Status& s) { return std::string(s.ToString()); };
  // The KV cache layout: earlier turns stacked, or one full prefill.
  sharding::KvLayout cache;
  const sharding::KvLayout* cache_ptr = nullptr;
  if (!c.turns.empty()) {
    const int b = static_cast<int>(c.sequences.size());
    cache.cp_size = grid.cp_size;
    cache.runs.assign(grid.cp_size, std::vector<std::vector<sharding::PositionRun>>(b));
    std::vector<int64_t> cached(b, 0);
    for (size_t t = 0; t < c.turns[0].size(); ++t) {
      std::vector<SequenceRequest> turn;
      for (int s = 0; s < b; ++s) turn.push_back({c.turns[s][t], cached[s]});
      auto plan = sharding::PlanPrefill(turn, grid.cp_size, &cache);
      if (!plan.ok()) return fail(plan.status());
      cache = plan->KvLayoutAfter();
      for (int s = 0; s < b; ++s) cached[s] += c.turns[s][t];
    }
    cache_ptr = &cache;
  }
  auto plan = sharding::PlanPrefill(c.sequences, grid.cp_size, cache_ptr);
  if (!plan.ok()) return fail(plan.status());

  const attention::AttentionShape shape{.num_heads = c.heads / grid.tp_size,
                                        .num_kv_heads = c.kv_heads / grid.tp_size,
                                        .head_dim = c.head_dim,
                                        .softmax_scale = 1.0f / std::sqrt(float(c.head_dim)),
                                        .causal = c.causal};
  auto ring = parallel::MixedRing::Create(*grid.cp, *plan, shape, &ops);
  if (!ring.ok()) return fail(ring.status());
  // Another ring made on the same ops after this one (a model makes one per prefill) replaces
  // the positions the ops hold: the first ring's runs must put its own back.
  auto other_plan = sharding::PlanPrefill({{.new_tokens = 5 * grid.cp_size}}, grid.cp_size);
  if (!other_plan.ok()) return fail(other_plan.status());
  auto other = parallel::RingAttention::Create(*grid.cp, *other_plan, shape, &ops);
  if (!other.ok()) return fail(other.status());
  const auto& layout = (*ring)->layout();
  const launch::SyntheticAttention batch{.sequences = c.sequences,
                                         .num_heads = c.heads,
                                         .num_kv_heads = c.kv_heads,
                                         .head_dim = c.head_dim,
                                         .seed = 1234};
  std::vector<float> q(layout.q_rows() * shape.num_heads * c.head_dim);
  std::vector<float> k(layout.kv_rows() * shape.num_kv_heads * c.head_dim), v(k.size());
  batch.FillLocal(layout,
                  launch::HeadSlice::ForTpRank(c.heads, c.kv_heads, grid.tp_rank, grid.tp_size),
                  q.data(), k.data(), v.data());
  std::vector<float> o(q.size(), std::nanf("")),
      lse(layout.q_rows() * shape.num_heads, std::nanf(""));
  // Twice, with the other ring run in between: the second run reuses the buffers of the others,
  // which must leave nothing behind, and takes its positions back.
  const int64_t row_floats = int64_t{shape.num_kv_heads} * c.head_dim;
  const HostPool pool =
      variant == Variant::kPagedEnqueue ? PoolOf(layout, k, v, row_floats) : HostPool{};
  const attention::PagedKv paged = pool.View(row_floats);
  parallel::RunOptions options{.wait = variant == Variant::kWait};
  const float* k_in = k.data();
  const float* v_in = v.data();
  if (variant == Variant::kPagedEnqueue) {
    options.paged_kv = &paged;
    k_in = pool.k.data();
    v_in = pool.v.data();
  }
  for (int run = 0; run < 2; ++run) {
    parallel::RingTimings timings;
    absl::Status s =
        (*ring)->Run(algos, q.data(), k_in, v_in, o.data(), lse.data(), &timings, nullptr, options);
    if (s.ok() && !options.wait) s = (*ring)->Finish();
    if (!s.ok()) return fail(s);
    if (run == 1) break;
    const auto& ol = (*other)->layout();
    std::vector<float> oq(ol.q_rows() * shape.num_heads * c.head_dim, 1.0f);
    std::vector<float> okv(ol.kv_rows() * shape.num_kv_heads * c.head_dim, 1.0f);
    std::vector<float> oo(oq.size()), olse(ol.q_rows() * shape.num_heads);
    if (absl::Status s = (*other)->Run(algos[0], oq.data(), okv.data(), okv.data(), oo.data(),
                                       olse.data(), nullptr);
        !s.ok()) {
      return fail(s);
    }
  }
  std::vector<float> o_all, lse_all;
  if (absl::Status s = parallel::GatherAttentionOutputs(
          *grid.world, *plan, grid.tp_rank, grid.tp_size, grid.cp_rank, c.heads, c.head_dim,
          o.data(), lse.data(), &o_all, &lse_all);
      !s.ok()) {
    return fail(s);
  }
  if (grid.world_rank != 0) return "";

  std::vector<float> q_all(batch.total_new_tokens() * c.heads * c.head_dim);
  std::vector<float> k_all(batch.total_kv_tokens() * c.kv_heads * c.head_dim), v_all(k_all.size());
  batch.FillGlobal(q_all.data(), k_all.data(), v_all.data());
  attention::AttentionShape full = shape;
  full.num_heads = c.heads;
  full.num_kv_heads = c.kv_heads;
  std::vector<float> o_ref(o_all.size(), std::nanf("")), lse_ref(lse_all.size(), std::nanf(""));
  if (absl::Status s =
          parallel::SingleRankAttention(c.sequences, full, q_all.data(), k_all.data(), v_all.data(),
                                        o_ref.data(), lse_ref.data(), &ops);
      !s.ok()) {
    return fail(s);
  }
  constexpr double kTolerance = 5e-5;  // fp32: merge order differs from one softmax pass
  double max_o = 0, max_lse = 0;
  for (size_t i = 0; i < o_all.size(); ++i) {
    if (!std::isfinite(o_all[i])) return absl::StrCat("O[", i, "] is ", o_all[i]);
    max_o = std::max(max_o, std::fabs(double(o_all[i]) - o_ref[i]));
  }
  for (size_t i = 0; i < lse_all.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      if (!(std::isinf(lse_all[i]) && lse_all[i] < 0)) {
        return absl::StrCat("LSE[", i, "] = ", lse_all[i], ", single rank -inf");
      }
      continue;
    }
    if (std::isnan(lse_all[i])) return absl::StrCat("LSE[", i, "] is NaN");
    max_lse = std::max(max_lse, std::fabs(double(lse_all[i]) - lse_ref[i]));
  }
  if (max_o > kTolerance || max_lse > kTolerance) {
    return absl::StrCat("max |O - O_1rank| = ", max_o, ", max |LSE - LSE_1rank| = ", max_lse);
  }
  return "";
}

std::vector<Case> Cases() {
  return {
      {.name = "full prefill, one sequence that divides by 2N", .sequences = {{.new_tokens = 240}}},
      {.name = "full prefill, uneven fused batch (not divisible, empty, length 1)",
       .sequences = {{.new_tokens = 517},
                     {.new_tokens = 0},
                     {.new_tokens = 1},
                     {.new_tokens = 33},
                     {.new_tokens = 2}}},
      {.name = "partial prefill after one full prefill",
       .sequences = {{.new_tokens = 101, .cached_tokens = 300},
                     {.new_tokens = 7, .cached_tokens = 59},
                     {.new_tokens = 64, .cached_tokens = 0}}},
      {.name = "partial prefill, few new tokens on a long cache (pass-Q territory)",
       .sequences = {{.new_tokens = 3, .cached_tokens = 700},
                     {.new_tokens = 1, .cached_tokens = 5}}},
      {.name = "one new token after each of three caches (every query on rank 0: the other "
               "ranks send empty pass-Q messages and merge nothing)",
       .sequences = {{.new_tokens = 1, .cached_tokens = 40},
                     {.new_tokens = 1, .cached_tokens = 9},
                     {.new_tokens = 1, .cached_tokens = 130}}},
      {.name = "partial prefill on a cache built by three earlier turns",
       .sequences = {{.new_tokens = 50, .cached_tokens = 431},
                     {.new_tokens = 13, .cached_tokens = 31}},
       .turns = {{200, 1, 230}, {10, 20, 1}}},
      {.name = "GQA 8:1, head dim 64",
       .sequences = {{.new_tokens = 190, .cached_tokens = 17}},
       .heads = 8,
       .kv_heads = 1,
       .head_dim = 64},
      {.name = "non-causal",
       .sequences = {{.new_tokens = 77, .cached_tokens = 20}, {.new_tokens = 5}},
       .causal = false},
  };
}

void RunAllCases(int tp) {
  auto& mpi = testing::Mpi();
  if (mpi.world_size() % tp != 0) GTEST_SKIP() << "TP" << tp << " needs a multiple of " << tp;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp});
  ASSERT_TRUE(grid.ok()) << grid.status();
  // One ops object for every case, as a model keeps one: its buffers, sized for one plan, are
  // reused (or grown) by the next.
  ThreadPool pool(2);
  parallel::CpuRingOps ops(&pool);
  const std::vector<RingAlgorithm> kinds = {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ,
                                            RingAlgorithm::kAllGather};
  for (const Case& c : Cases()) {
    if (c.kv_heads % tp != 0) continue;
    const int n = static_cast<int>(c.sequences.size());
    // Every sequence on one algorithm, then mixed batches: the algorithms in turn (a ring per
    // sequence's run: pass-kv, pass-q, all-gather, pass-kv, ...), and grouped (two rings).
    std::vector<std::vector<RingAlgorithm>> plans;
    for (RingAlgorithm a : kinds) plans.emplace_back(n, a);
    if (n > 1) {
      std::vector<RingAlgorithm> turns, grouped;
      for (int s = 0; s < n; ++s) {
        turns.push_back(kinds[s % 3]);
        grouped.push_back(s < n / 2 ? RingAlgorithm::kPassKV : RingAlgorithm::kPassQ);
      }
      plans.push_back(turns);
      plans.push_back(grouped);
    }
    // Enqueued runs on every single algorithm, and pass-Q reading blocks in place (decode's).
    std::vector<std::pair<std::vector<RingAlgorithm>, Variant>> runs;
    for (const std::vector<RingAlgorithm>& algos : plans) runs.push_back({algos, Variant::kWait});
    for (RingAlgorithm a : kinds) runs.push_back({std::vector(n, a), Variant::kEnqueue});
    runs.push_back({std::vector(n, RingAlgorithm::kPassQ), Variant::kPagedEnqueue});
    for (const auto& [algos, variant] : runs) {
      const std::string error = RunAndCompare(*grid, c, algos, ops, variant);
      // Every rank agrees on the verdict of each case.
      auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
      ASSERT_TRUE(agreed.ok()) << agreed.status();
      EXPECT_TRUE(*agreed) << c.name << ", " << parallel::AlgorithmsName(algos)
                           << (variant == Variant::kEnqueue        ? " (enqueued)"
                               : variant == Variant::kPagedEnqueue ? " (paged K/V)"
                                                                   : "")
                           << ", " << grid->Describe() << ": "
                           << (error.empty() ? "failed on another rank" : error);
    }
  }
}

TEST(RingAttention, EqualsSingleRankOnEveryCaseCpOnly) { RunAllCases(/*tp=*/1); }

TEST(RingAttention, EqualsSingleRankOnEveryCaseTp2) { RunAllCases(/*tp=*/2); }

TEST(Communicator, AllToAllWithUnevenSizesAndRingExchange) {
  auto& mpi = testing::Mpi();
  auto world = mpi.World();
  const int n = world->size(), me = world->rank();
  // Rank r sends (r + 1) * (p + 1) int32 values, all equal to 100 r + p, to peer p.
  std::vector<size_t> sb(n), so(n), rb(n), ro(n);
  std::vector<int32_t> send, recv;
  for (int p = 0; p < n; ++p) {
    so[p] = send.size() * 4;
    for (int i = 0; i < (me + 1) * (p + 1); ++i) send.push_back(100 * me + p);
    sb[p] = (me + 1) * (p + 1) * 4;
    ro[p] = recv.size() * 4;
    recv.resize(recv.size() + (p + 1) * (me + 1), -1);
    rb[p] = (p + 1) * (me + 1) * 4;
  }
  ASSERT_TRUE(world->AllToAll(send.data(), sb, so, recv.data(), rb, ro).ok());
  for (int p = 0; p < n; ++p) {
    for (size_t i = 0; i < rb[p] / 4; ++i) EXPECT_EQ(recv[ro[p] / 4 + i], 100 * p + me);
  }
  std::vector<int64_t> out(1000, me), in(1000, -1);
  auto ex = world->StartRingExchange(out.data(), in.data(), out.size() * 8);
  ASSERT_TRUE(ex.ok());
  ASSERT_TRUE((*ex)->Wait().ok());
  EXPECT_EQ(in[0], world->prev_rank());
  EXPECT_EQ(in[999], world->prev_rank());
  double x = me;
  ASSERT_TRUE(world->AllReduce(&x, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kSum).ok());
  EXPECT_EQ(x, n * (n - 1) / 2.0);
  int32_t b = me == 0 ? 42 : 0;
  ASSERT_TRUE(world->Broadcast(&b, sizeof(b), 0).ok());
  EXPECT_EQ(b, 42);
}

TEST(ProcessGrid, EmulatedNodesAndTpGroups) {
  auto& mpi = testing::Mpi();
  const int n = mpi.world_size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even rank count";
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = 2, .ranks_per_node = 2});
  ASSERT_TRUE(grid.ok()) << grid.status();
  EXPECT_EQ(grid->num_nodes, n / 2);
  EXPECT_EQ(grid->tp_size, 2);
  EXPECT_EQ(grid->cp_size, n / 2);
  EXPECT_EQ(grid->tp_rank, grid->world_rank % 2);
  EXPECT_EQ(grid->cp_rank, grid->world_rank / 2);
  // A TP that does not divide the ranks per node is refused on every rank alike.
  auto bad = parallel::CreateProcessGrid(mpi, {.tp = 3, .ranks_per_node = 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cpfill
