// PartialAttentionCpu against the fp64 reference, ValidateAttentionParams and CountVisiblePairs.

#include "attention/attention.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/reference.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"

namespace cpfill::attention {
namespace {

using testing::ExpectMatchesReference;
using testing::MakeProblem;
using testing::MakeShape;
using testing::Problem;
using testing::RunAndPoison;

// ---- Shapes: GQA group size x head_dim x causal ---------------------------------------------

class ShapeTest : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(ShapeTest, MatchesReferenceOnOneSequence) {
  const auto [group, head_dim, causal] = GetParam();
  const int kv_heads = 2;
  ThreadPool pool(2);
  // 150 tokens: two full key tiles and a partial one; query tiles end unevenly too.
  for (uint64_t seed : {1u, 2u}) {
    Problem pb = MakeProblem(MakeShape(group * kv_heads, kv_heads, head_dim, causal), 150, 150,
                             seed * 100 + group + head_dim);
    pb.slices = {{0, 150, 0, 150}};
    ASSERT_TRUE(RunAndPoison(pb, &pool).ok());
    ExpectMatchesReference(pb);
  }
}

INSTANTIATE_TEST_SUITE_P(GroupsDimsMasks, ShapeTest,
                         ::testing::Combine(::testing::Values(1, 8, 16),
                                            ::testing::Values(64, 128, 40), ::testing::Bool()),
                         [](const auto& info) {
                           return "g" + std::to_string(std::get<0>(info.param)) + "_d" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_causal" : "_full");
                         });

// ---- Positions from ring steps and partial prefill -----------------------------------------

TEST(PartialAttentionCpuTest, RingStepLaterQueriesSeeEveryKey) {
  // Query chunk [3000, 3100) against an earlier rank's keys [0, 200): every tile fully visible.
  Problem pb = MakeProblem(MakeShape(16, 1, 128, true), 100, 200, 11);
  for (int i = 0; i < 100; ++i) pb.q_pos[i] = 3000 + i;
  pb.slices = {{0, 100, 0, 200}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
  for (float l : pb.lse) EXPECT_TRUE(std::isfinite(l));
}

TEST(PartialAttentionCpuTest, RingStepEarlierQueriesSeeNothing) {
  // Query chunk [0, 100) against a later rank's keys [3000, 3200): every row empty.
  Problem pb = MakeProblem(MakeShape(8, 1, 64, true), 100, 200, 12);
  for (int i = 0; i < 200; ++i) pb.k_pos[i] = 3000 + i;
  pb.slices = {{0, 100, 0, 200}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  for (float l : pb.lse) EXPECT_EQ(l, kNegInf);
  for (float x : pb.o) ASSERT_EQ(x, 0.0f);
}

TEST(PartialAttentionCpuTest, RingStepDiagonalChunkPairsOfLoadBalancedShard) {
  // A load-balanced shard holds two chunks of the sequence, e.g. [64, 128) and [448, 512);
  // keys arrive as the same two chunks: tiles mix fully visible, diagonal and hidden.
  Problem pb = MakeProblem(MakeShape(16, 2, 128, true), 128, 128, 13);
  for (int i = 0; i < 64; ++i) {
    pb.q_pos[i] = pb.k_pos[i] = 64 + i;
    pb.q_pos[64 + i] = pb.k_pos[64 + i] = 448 + i;
  }
  pb.slices = {{0, 128, 0, 128}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
}

TEST(PartialAttentionCpuTest, PartialPrefillAfterCachedKeys) {
  // 300 cached tokens, then 77 new ones: queries at [300, 377) over keys [0, 377).
  for (int group : {1, 8}) {
    Problem pb = MakeProblem(MakeShape(group * 2, 2, 64, true), 77, 377, 14 + group);
    for (int i = 0; i < 77; ++i) pb.q_pos[i] = 300 + i;
    pb.slices = {{0, 77, 0, 377}};
    ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
    ExpectMatchesReference(pb);
  }
}

TEST(PartialAttentionCpuTest, KeysOutOfPositionOrder) {
  // Nothing in the contract orders keys by position; shuffle them.
  Problem pb = MakeProblem(MakeShape(8, 1, 64, true), 130, 200, 15);
  std::mt19937 rng(15);
  std::shuffle(pb.k_pos.begin(), pb.k_pos.end(), rng);
  std::shuffle(pb.q_pos.begin(), pb.q_pos.end(), rng);
  pb.slices = {{0, 130, 0, 200}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
}

// ---- Fused batches and slice edge cases ----------------------------------------------------

TEST(PartialAttentionCpuTest, UnevenFusedBatchWithEmptyAndTinySlices) {
  // Slices of length 0, 1, 17, 200 and one with keys but no queries, packed back to back.
  for (bool causal : {true, false}) {
    // q rows: [0,1) [1,18) [18,218) [218,233); kv rows: [0,1) [1,18) [18,218) [218,288).
    Problem pb = MakeProblem(MakeShape(8, 1, 128, causal), 233, 300, causal ? 21 : 22);
    pb.slices = {{0, 1, 0, 1},         // length 1
                 {1, 17, 1, 17},       // length 17
                 {18, 0, 0, 5},        // no queries
                 {18, 200, 18, 200},   // several tiles
                 {218, 0, 0, 0},       // empty
                 {218, 15, 218, 70}};  // partial prefill: 55 cached + 15 new
    for (int i = 0; i < 1; ++i) pb.q_pos[i] = pb.k_pos[i] = i;
    for (int i = 0; i < 17; ++i) pb.q_pos[1 + i] = pb.k_pos[1 + i] = i;
    for (int i = 0; i < 200; ++i) pb.q_pos[18 + i] = pb.k_pos[18 + i] = i;
    for (int i = 0; i < 70; ++i) pb.k_pos[218 + i] = i;
    for (int i = 0; i < 15; ++i) pb.q_pos[218 + i] = 55 + i;
    ThreadPool pool(2);
    ASSERT_TRUE(RunAndPoison(pb, &pool).ok());
    ExpectMatchesReference(pb);
  }
}

TEST(PartialAttentionCpuTest, SlicesMayShareKeyRows) {
  // Two queries sets over the same cached prefix (e.g. two requests sharing a system prompt).
  Problem pb = MakeProblem(MakeShape(4, 2, 64, true), 40, 100, 23);
  for (int i = 0; i < 20; ++i) pb.q_pos[i] = pb.q_pos[20 + i] = 80 + i;
  pb.slices = {{0, 20, 0, 100}, {20, 20, 0, 90}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
}

TEST(PartialAttentionCpuTest, RowsInNoSliceAreEmpty) {
  Problem pb = MakeProblem(MakeShape(8, 2, 64, false), 100, 100, 24);
  pb.slices = {{60, 30, 0, 100}, {10, 20, 0, 50}};  // rows [0,10) [30,60) [90,100) uncovered
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
  for (int row : {0, 9, 30, 59, 90, 99}) EXPECT_EQ(pb.lse[row * 8], kNegInf) << row;
}

TEST(PartialAttentionCpuTest, NoSlicesWritesEveryRowEmpty) {
  Problem pb = MakeProblem(MakeShape(2, 1, 40, true), 7, 7, 25);
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  for (float l : pb.lse) EXPECT_EQ(l, kNegInf);
  for (float x : pb.o) ASSERT_EQ(x, 0.0f);
}

// ---- Masking -------------------------------------------------------------------------------

TEST(PartialAttentionCpuTest, FullyMaskedRowsGetMinusInfAndZero) {
  // Keys at [50, 250); queries at [0, 100): rows before 50 see nothing, the rest see some.
  Problem pb = MakeProblem(MakeShape(16, 1, 64, true), 100, 200, 26);
  for (int i = 0; i < 200; ++i) pb.k_pos[i] = 50 + i;
  pb.slices = {{0, 100, 0, 200}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  ExpectMatchesReference(pb);
  for (int row = 0; row < 50; ++row) {
    for (int h = 0; h < 16; ++h) EXPECT_EQ(pb.lse[row * 16 + h], kNegInf);
  }
  for (int row = 50; row < 100; ++row) EXPECT_TRUE(std::isfinite(pb.lse[row * 16]));
}

TEST(PartialAttentionCpuTest, PaddingQueriesAndKeys) {
  for (bool causal : {true, false}) {
    Problem pb = MakeProblem(MakeShape(8, 1, 128, causal), 150, 150, causal ? 27 : 28);
    std::mt19937 rng(29);
    for (int i = 0; i < 150; ++i) {
      if (rng() % 5 == 0) pb.q_pos[i] = kPadPosition;
      if (rng() % 4 == 0) pb.k_pos[i] = kPadPosition;
    }
    // A whole key tile of padding, and a whole query tile (16 tokens for group 8) of padding.
    for (int i = 64; i < 128; ++i) pb.k_pos[i] = kPadPosition;
    for (int i = 16; i < 32; ++i) pb.q_pos[i] = kPadPosition;
    pb.slices = {{0, 150, 0, 150}};
    ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
    ExpectMatchesReference(pb);
    for (int i = 0; i < 150; ++i) {
      if (pb.q_pos[i] < 0) {
        EXPECT_EQ(pb.lse[i * 8], kNegInf) << i;
      }
    }
  }
}

TEST(PartialAttentionCpuTest, LargeScoresStayFinite) {
  // Scores in the hundreds: the running max must keep every exponential in range.
  Problem pb = MakeProblem(MakeShape(4, 1, 64, true), 150, 150, 30, /*amplitude=*/6.0f);
  pb.shape.softmax_scale = 1.0f;
  pb.slices = {{0, 150, 0, 150}};
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  std::vector<double> ref_o, ref_lse;
  ReferenceAttention(pb.Params(), &ref_o, &ref_lse);
  // LSE in the hundreds carries fp32 rounding of the scores themselves: relative tolerance.
  double max_lse = 0.0;
  for (double l : ref_lse) max_lse = std::max(max_lse, std::abs(l));
  ASSERT_GT(max_lse, 100.0);
  testing::ExpectOutputsMatch(pb.shape, pb.q_tokens, pb.o.data(), pb.lse.data(), ref_o, ref_lse,
                              /*o_rel_tol=*/1e-4, /*lse_tol=*/2e-6 * max_lse);
}

// ---- Threads -------------------------------------------------------------------------------

TEST(PartialAttentionCpuTest, ThreadCountDoesNotChangeResults) {
  Problem pb = MakeProblem(MakeShape(16, 2, 64, true), 300, 300, 31);
  pb.slices = {{0, 120, 0, 120}, {120, 180, 120, 180}};
  for (int i = 0; i < 180; ++i) pb.q_pos[120 + i] = pb.k_pos[120 + i] = i;
  ASSERT_TRUE(RunAndPoison(pb, nullptr).ok());
  const std::vector<float> o1 = pb.o, lse1 = pb.lse;
  for (int threads : {2, 4}) {
    ThreadPool pool(threads);
    ASSERT_TRUE(RunAndPoison(pb, &pool).ok());
    // Each row is computed by one item in a fixed order: results are bitwise identical.
    EXPECT_EQ(std::memcmp(o1.data(), pb.o.data(), o1.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(lse1.data(), pb.lse.data(), lse1.size() * sizeof(float)), 0) << threads;
  }
  ExpectMatchesReference(pb);
}

// ---- Validation ----------------------------------------------------------------------------

class ValidationTest : public ::testing::Test {
 protected:
  ValidationTest() : pb_(MakeProblem(MakeShape(4, 2, 16, true), 10, 12, 40)) {
    pb_.slices = {{0, 4, 0, 6}, {4, 6, 6, 6}};
  }
  absl::StatusCode Code(const AttentionParams& p) {
    const absl::Status s = ValidateAttentionParams(p);
    // Every error names its problem; the kernel must return the same error.
    if (!s.ok()) {
      EXPECT_FALSE(s.message().empty());
      EXPECT_EQ(PartialAttentionCpu(p, nullptr).code(), s.code());
    }
    return s.code();
  }
  Problem pb_;
};

TEST_F(ValidationTest, AcceptsGoodParams) { EXPECT_EQ(Code(pb_.Params()), absl::StatusCode::kOk); }

TEST_F(ValidationTest, RejectsBadShapes) {
  const auto bad = absl::StatusCode::kInvalidArgument;
  AttentionParams p = pb_.Params();
  p.shape.num_heads = 0;
  EXPECT_EQ(Code(p), bad);
  p = pb_.Params();
  p.shape.num_kv_heads = -1;
  EXPECT_EQ(Code(p), bad);
  p = pb_.Params();
  p.shape.head_dim = 0;
  EXPECT_EQ(Code(p), bad);
  p = pb_.Params();
  p.shape.num_kv_heads = 3;  // 4 % 3 != 0
  EXPECT_EQ(Code(p), bad);
  p = pb_.Params();
  p.shape.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Code(p), bad);
  p = pb_.Params();
  p.q_tokens = -1;
  EXPECT_EQ(Code(p), bad);
}

TEST_F(ValidationTest, RejectsNullPointers) {
  const auto bad = absl::StatusCode::kInvalidArgument;
  for (int which = 0; which < 8; ++which) {
    AttentionParams p = pb_.Params();
    switch (which) {
      case 0:
        p.q = nullptr;
        break;
      case 1:
        p.q_pos = nullptr;
        break;
      case 2:
        p.k = nullptr;
        break;
      case 3:
        p.v = nullptr;
        break;
      case 4:
        p.k_pos = nullptr;
        break;
      case 5:
        p.o = nullptr;
        break;
      case 6:
        p.lse = nullptr;
        break;
      case 7:
        p.slices = nullptr;
        break;
    }
    EXPECT_EQ(Code(p), bad) << which;
  }
  // Null is fine where the size is zero.
  AttentionParams p = pb_.Params();
  p.kv_tokens = 0;
  p.k = p.v = nullptr;
  p.k_pos = nullptr;
  p.num_slices = 0;
  p.slices = nullptr;
  EXPECT_EQ(Code(p), absl::StatusCode::kOk);
}

TEST_F(ValidationTest, RejectsSlicesOutOfRange) {
  const auto bad = absl::StatusCode::kInvalidArgument;
  const SequenceSlice cases[] = {
      {-1, 2, 0, 2},
      {0, -1, 0, 2},
      {0, 2, -1, 2},
      {0, 2, 0, -1},  // negative
      {8, 3, 0, 2},
      {11, 0, 0, 2},
      {0, 2, 10, 3},
      {0, 2, 13, 0},                                   // past the end
      {0, 2, 0, std::numeric_limits<int64_t>::max()},  // overflow-sized
  };
  for (const SequenceSlice& s : cases) {
    pb_.slices = {s};
    EXPECT_EQ(Code(pb_.Params()), bad)
        << s.q_begin << " " << s.q_len << " " << s.kv_begin << " " << s.kv_len;
  }
  pb_.slices = {{10, 0, 12, 0}};  // empty slices at the very end are in range
  EXPECT_EQ(Code(pb_.Params()), absl::StatusCode::kOk);
}

TEST_F(ValidationTest, RejectsSlicesSharingQueryRows) {
  const auto bad = absl::StatusCode::kInvalidArgument;
  pb_.slices = {{5, 5, 0, 12}, {0, 3, 0, 12}, {2, 2, 0, 12}};  // [2,4) overlaps [0,3), unsorted
  EXPECT_EQ(Code(pb_.Params()), bad);
  pb_.slices = {{0, 10, 0, 12}, {4, 1, 0, 12}};  // nested
  EXPECT_EQ(Code(pb_.Params()), bad);
  pb_.slices = {{0, 5, 0, 12}, {5, 5, 0, 12}, {3, 0, 0, 12}};  // adjacent; empty inside: fine
  EXPECT_EQ(Code(pb_.Params()), absl::StatusCode::kOk);
}

// ---- CountVisiblePairs ---------------------------------------------------------------------

int64_t BruteForcePairs(const AttentionParams& p) {
  int64_t n = 0;
  for (int64_t si = 0; si < p.num_slices; ++si) {
    const SequenceSlice& s = p.slices[si];
    for (int64_t i = s.q_begin; i < s.q_begin + s.q_len; ++i) {
      for (int64_t j = s.kv_begin; j < s.kv_begin + s.kv_len; ++j) {
        if (p.q_pos[i] >= 0 && p.k_pos[j] >= 0 && (!p.shape.causal || p.k_pos[j] <= p.q_pos[i]))
          ++n;
      }
    }
  }
  return n;
}

TEST(CountVisiblePairsTest, MatchesBruteForce) {
  std::mt19937 rng(50);
  for (int trial = 0; trial < 40; ++trial) {
    Problem pb = MakeProblem(MakeShape(2, 1, 8, trial % 2 == 0), 120, 150, trial);
    for (auto& x : pb.q_pos)
      x = (rng() % 6 == 0) ? kPadPosition : static_cast<int32_t>(rng() % 200);
    for (auto& x : pb.k_pos)
      x = (rng() % 6 == 0) ? kPadPosition : static_cast<int32_t>(rng() % 200);
    pb.slices = {{0, 50, 0, 100}, {50, 0, 10, 20}, {50, 70, 20, 130}, {120, 0, 150, 0}};
    EXPECT_EQ(CountVisiblePairs(pb.Params()), BruteForcePairs(pb.Params())) << trial;
  }
}

TEST(CountVisiblePairsTest, MillionTokenCausalSlice) {
  // Must be fast (sort + binary search), and exact: n (n + 1) / 2 for a causal prefill.
  const int64_t n = 1 << 20;
  std::vector<int32_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  const SequenceSlice slice{0, n, 0, n};
  AttentionParams p{.shape = MakeShape(1, 1, 1, true),
                    .q = reinterpret_cast<const float*>(pos.data()),  // never read
                    .q_pos = pos.data(),
                    .q_tokens = n,
                    .k = reinterpret_cast<const float*>(pos.data()),
                    .v = reinterpret_cast<const float*>(pos.data()),
                    .k_pos = pos.data(),
                    .kv_tokens = n,
                    .slices = &slice,
                    .num_slices = 1,
                    .o = reinterpret_cast<float*>(pos.data()),
                    .lse = reinterpret_cast<float*>(pos.data())};
  EXPECT_EQ(CountVisiblePairs(p), n * (n + 1) / 2);
  p.shape.causal = false;
  EXPECT_EQ(CountVisiblePairs(p), n * n);
}

}  // namespace
}  // namespace cpfill::attention
