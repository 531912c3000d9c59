// SparQ over CP (parallel/sparq_cp.h) on the 2N-chunk sharding, under mpirun with 1-4 ranks:
// kGlobalTopK equals one-rank SparQ (same positions, output within fp32 rounding) and the fp64
// reference; kLocalTopK equals its own definition (each rank's top ceil(k/N) by its local
// softmax, alpha and output of Alg. 1 over their union), computed in fp64 from the whole batch.
#include <limits>

#include "attention/sparq/reference.h"
#include "attention/sparq/sparq_cpu.h"
#include "attention/sparq/sparq_test_util.h"
#include "gtest/gtest.h"
#include "parallel/sparq_cp.h"
#include "sharding/plan.h"
#include "tests/mpi_test_main.h"

namespace cpfill::parallel {
namespace {

using attention::sparq::SparqBatch;
using attention::sparq::SparqConfig;
using attention::sparq::SparqReference;
using attention::sparq::SparqReferenceResult;
using attention::sparq::SparqSelection;
using attention::sparq::SparqShape;
using attention::sparq::testing::ConfigName;
using attention::sparq::testing::RandomSparqBatch;
using attention::sparq::testing::WorstRatio;

constexpr double kMinMargin = 1e-4;  // selections compared where no near-tie (reference.h)

// CP rank `cp_rank`'s rows of `full`: chunks cp_rank and 2N-1-cp_rank of each sequence.
struct Shard {
  std::vector<int64_t> begin, len, seq_len;
  std::vector<int32_t> pos;
  std::vector<float> k, v;
  SparqBatch batch;

  Shard(const RandomSparqBatch& full, int cp_size, int cp_rank, SparqConfig config) {
    const int64_t row_floats = full.shape.num_kv_heads * full.shape.head_dim;
    for (size_t s = 0; s < full.len.size(); ++s) {
      const std::vector<int64_t> chunks = sharding::ChunkSizes(full.len[s], cp_size);
      begin.push_back(static_cast<int64_t>(pos.size()));
      int64_t chunk_start = 0;
      for (int c = 0; c < 2 * cp_size; ++c) {
        if (c == cp_rank || c == 2 * cp_size - 1 - cp_rank) {
          for (int64_t p = chunk_start; p < chunk_start + chunks[c]; ++p) {
            pos.push_back(static_cast<int32_t>(p));
            const float* src = &full.k[(full.begin[s] + p) * row_floats];
            k.insert(k.end(), src, src + row_floats);
            const float* vsrc = &full.v[(full.begin[s] + p) * row_floats];
            v.insert(v.end(), vsrc, vsrc + row_floats);
          }
        }
        chunk_start += chunks[c];
      }
      len.push_back(static_cast<int64_t>(pos.size()) - begin.back());
      seq_len.push_back(full.len[s]);
    }
    batch = {.shape = full.shape,
             .config = config,
             .q = full.q.data(),
             .k = k.data(),
             .v = v.data(),
             .kv_begin = begin,
             .kv_len = len,
             .k_pos = pos.data(),
             .seq_len = seq_len};
  }
};

struct Case {
  SparqShape shape;
  std::vector<int64_t> lens;
  SparqConfig config;
};

std::vector<Case> Cases() {
  return {
      {{8, 2, 64}, {1000, 37}, {.r = 8, .k = 32, .local_window = 4}},
      {{32, 8, 128}, {3000}, {.r = 16, .k = 128, .local_window = 16}},
      {{4, 4, 128}, {2048, 5, 700}, {.r = 32, .k = 64, .local_window = 0}},
      {{8, 1, 64}, {900}, {.r = 64, .k = 50, .local_window = 70}},  // r = d, window > k
      {{8, 1, 64}, {120}, {.r = 8, .k = 200, .local_window = 3}},   // k >= S: dense
  };
}

std::vector<float> Poisoned(const RandomSparqBatch& data) {
  return std::vector<float>(data.len.size() * data.shape.num_heads * data.shape.head_dim,
                            std::numeric_limits<float>::quiet_NaN());
}

TEST(SparqCp, GlobalTopKEqualsOneRank) {
  auto cp = testing::Mpi().World();
  ThreadPool pool(1);
  uint64_t seed = 100;
  for (const Case& c : Cases()) {
    const std::string name = ConfigName(c.shape, c.config);
    RandomSparqBatch full(c.shape, c.lens, ++seed);
    Shard shard(full, cp->size(), cp->rank(), c.config);
    auto o = Poisoned(full), one = Poisoned(full);
    SparqSelection sel, sel_one;
    ASSERT_TRUE(
        SparqAttentionCp(*cp, shard.batch, SparqCpSelection::kGlobalTopK, o.data(), &sel, &pool)
            .ok())
        << name;
    ASSERT_TRUE(
        attention::sparq::SparqAttentionCpu(full.Batch(c.config), one.data(), &sel_one, &pool)
            .ok());
    const SparqReferenceResult ref = SparqReference(full.Batch(c.config));
    for (size_t i = 0; i < ref.selected.size(); ++i) {
      if (ref.margin[i] < kMinMargin) continue;
      EXPECT_EQ(sel.positions[i], sel_one.positions[i]) << name << " group " << i;
      EXPECT_EQ(sel.positions[i], ref.selected[i]) << name << " group " << i;
    }
    EXPECT_LE(WorstRatio(o, one, 1e-6, 1e-5), 1.0) << name << " vs one rank";
    EXPECT_LE(WorstRatio(o, ref.o, 2e-5, 2e-4), 1.0) << name << " vs fp64";
  }
}

// The local variant's definition in fp64: each rank's choice from its own rows alone.
std::vector<std::vector<int32_t>> LocalDefinition(const RandomSparqBatch& full, int cp_size,
                                                  SparqConfig config, std::vector<double>* margin) {
  SparqConfig per_rank = config;
  per_rank.k = (config.k + cp_size - 1) / cp_size;
  std::vector<std::vector<int32_t>> all(full.len.size() * full.shape.num_kv_heads);
  margin->assign(all.size(), INFINITY);
  for (int r = 0; r < cp_size; ++r) {
    Shard shard(full, cp_size, r, per_rank);
    const SparqReferenceResult ref = SparqReference(shard.batch);
    for (size_t i = 0; i < all.size(); ++i) {
      all[i].insert(all[i].end(), ref.selected[i].begin(), ref.selected[i].end());
      (*margin)[i] = std::min((*margin)[i], ref.margin[i]);
    }
  }
  for (auto& a : all) std::sort(a.begin(), a.end());
  return all;
}

TEST(SparqCp, LocalTopKMatchesItsDefinition) {
  auto cp = testing::Mpi().World();
  ThreadPool pool(1);
  uint64_t seed = 200;
  for (const Case& c : Cases()) {
    const std::string name = ConfigName(c.shape, c.config);
    RandomSparqBatch full(c.shape, c.lens, ++seed);
    Shard shard(full, cp->size(), cp->rank(), c.config);
    auto o = Poisoned(full);
    SparqSelection sel;
    ASSERT_TRUE(
        SparqAttentionCp(*cp, shard.batch, SparqCpSelection::kLocalTopK, o.data(), &sel, &pool)
            .ok())
        << name;
    std::vector<double> margin;
    const auto want = LocalDefinition(full, cp->size(), c.config, &margin);
    bool all_clear = true;
    for (size_t i = 0; i < want.size(); ++i) {
      if (margin[i] < kMinMargin) {
        all_clear = false;
        continue;
      }
      EXPECT_EQ(sel.positions[i], want[i]) << name << " group " << i;
    }
    if (!all_clear) continue;  // a near-tie: the output may differ by a swapped position
    const SparqReferenceResult ref = SparqReference(full.Batch(c.config), &want);
    EXPECT_LE(WorstRatio(o, ref.o, 2e-5, 2e-4), 1.0) << name << " vs its fp64 definition";
  }
}

TEST(SparqCp, RefusesAShardWithoutPositions) {
  auto cp = testing::Mpi().World();
  RandomSparqBatch full({8, 2, 64}, {64}, 1);
  auto o = Poisoned(full);
  const absl::Status st = SparqAttentionCp(
      *cp, full.Batch({.r = 8, .k = 8}), SparqCpSelection::kGlobalTopK, o.data(), nullptr, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

}  // namespace
}  // namespace cpfill::parallel
