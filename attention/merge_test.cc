// MergePartials / MergeInto: attention over disjoint key sets, merged, equals attention over all
// keys (paper App. B eq. 4); -inf parts and extreme LSE gaps never produce NaN.

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_test_util.h"
#include "attention/reference.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"

namespace cpfill::attention {
namespace {

using testing::ExpectOutputsMatch;
using testing::kNaN;
using testing::MakeProblem;
using testing::MakeShape;
using testing::Problem;
using testing::RunAndPoison;

struct Partial {
  std::vector<float> o, lse;
};

// Splits the keys of `pb` into `num_sets` random disjoint sets (a key outside a set is made a
// padding key) and runs attention on each set.
std::vector<Partial> AttentionOnKeySplits(Problem pb, int num_sets, uint64_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> set_of(pb.kv_tokens);
  for (auto& s : set_of) s = static_cast<int>(rng() % num_sets);
  const std::vector<int32_t> all_pos = pb.k_pos;
  std::vector<Partial> parts(num_sets);
  for (int s = 0; s < num_sets; ++s) {
    for (int64_t j = 0; j < pb.kv_tokens; ++j) pb.k_pos[j] = set_of[j] == s ? all_pos[j] : -1;
    EXPECT_TRUE(RunAndPoison(pb, nullptr).ok());
    parts[s].o = pb.o;
    parts[s].lse = pb.lse;
  }
  return parts;
}

std::vector<PartialView> Views(const std::vector<Partial>& parts) {
  std::vector<PartialView> views;
  for (const Partial& p : parts) views.push_back({p.o.data(), p.lse.data()});
  return views;
}

TEST(MergeTest, MergedSplitsEqualAttentionOnAllKeys) {
  ThreadPool pool(2);
  for (int num_sets = 2; num_sets <= 5; ++num_sets) {
    for (bool causal : {true, false}) {
      Problem pb = MakeProblem(MakeShape(8, 2, 64, causal), 90, 130, 60 + num_sets);
      pb.slices = {{0, 90, 0, 130}};
      for (int i = 0; i < 90; ++i) pb.q_pos[i] = 40 + i;  // the first rows see few keys
      const std::vector<Partial> parts = AttentionOnKeySplits(pb, num_sets, num_sets);
      std::vector<float> o(pb.o.size(), kNaN), lse(pb.lse.size(), kNaN);
      ASSERT_TRUE(
          MergePartials(pb.shape, pb.q_tokens, Views(parts), o.data(), lse.data(), &pool).ok());
      std::vector<double> ref_o, ref_lse;
      ReferenceAttention(pb.Params(), &ref_o, &ref_lse);
      ExpectOutputsMatch(pb.shape, pb.q_tokens, o.data(), lse.data(), ref_o, ref_lse);
    }
  }
}

TEST(MergeTest, MergeIntoChainEqualsMergePartials) {
  Problem pb = MakeProblem(MakeShape(4, 1, 40, true), 70, 70, 70);
  pb.slices = {{0, 70, 0, 70}};
  const std::vector<Partial> parts = AttentionOnKeySplits(pb, 4, 71);
  std::vector<float> o(pb.o.size()), lse(pb.lse.size());
  ASSERT_TRUE(
      MergePartials(pb.shape, pb.q_tokens, Views(parts), o.data(), lse.data(), nullptr).ok());
  Partial acc = parts[0];
  for (int s = 1; s < 4; ++s) {
    ASSERT_TRUE(MergeInto(pb.shape, pb.q_tokens, acc.o.data(), acc.lse.data(), parts[s].o.data(),
                          parts[s].lse.data(), nullptr)
                    .ok());
  }
  std::vector<double> o_d(o.begin(), o.end()), lse_d(lse.begin(), lse.end());
  ExpectOutputsMatch(pb.shape, pb.q_tokens, acc.o.data(), acc.lse.data(), o_d, lse_d, 1e-6, 1e-6);
}

TEST(MergeTest, OutputMayAliasFirstPart) {
  Problem pb = MakeProblem(MakeShape(4, 2, 64, false), 33, 50, 72);
  pb.slices = {{0, 33, 0, 50}};
  std::vector<Partial> parts = AttentionOnKeySplits(pb, 3, 73);
  std::vector<float> o(pb.o.size()), lse(pb.lse.size());
  ASSERT_TRUE(
      MergePartials(pb.shape, pb.q_tokens, Views(parts), o.data(), lse.data(), nullptr).ok());
  ThreadPool pool(2);
  ASSERT_TRUE(MergePartials(pb.shape, pb.q_tokens, Views(parts), parts[0].o.data(),
                            parts[0].lse.data(), &pool)
                  .ok());
  EXPECT_EQ(std::memcmp(o.data(), parts[0].o.data(), o.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(lse.data(), parts[0].lse.data(), lse.size() * sizeof(float)), 0);
}

// Hand-made one-row partials: shape of 1 head, head_dim 3.
class MergeRowTest : public ::testing::Test {
 protected:
  AttentionShape shape_ = MakeShape(1, 1, 3, true);

  // Merges rows given as (lse, o) pairs; returns {lse, o0, o1, o2}.
  std::vector<float> Merge(const std::vector<float>& lses,
                           const std::vector<std::vector<float>>& os) {
    std::vector<PartialView> views;
    for (size_t s = 0; s < lses.size(); ++s) views.push_back({os[s].data(), &lses[s]});
    std::vector<float> out = {kNaN, kNaN, kNaN, kNaN};
    EXPECT_TRUE(MergePartials(shape_, 1, views, out.data() + 1, out.data(), nullptr).ok());
    for (float x : out) EXPECT_FALSE(std::isnan(x));
    return out;
  }
};

TEST_F(MergeRowTest, MinusInfPartsContributeNothing) {
  const std::vector<float> out =
      Merge({kNegInf, 1.5f, kNegInf}, {{9, 9, 9}, {0.25f, -0.5f, 1}, {7, 7, 7}});
  EXPECT_FLOAT_EQ(out[0], 1.5f);
  EXPECT_FLOAT_EQ(out[1], 0.25f);
  EXPECT_FLOAT_EQ(out[2], -0.5f);
  EXPECT_FLOAT_EQ(out[3], 1.0f);
}

TEST_F(MergeRowTest, AllMinusInfGivesEmptyRow) {
  const std::vector<float> out = Merge({kNegInf, kNegInf}, {{kNaN, 1, 2}, {3, 4, 5}});
  EXPECT_EQ(out[0], kNegInf);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 0.0f);
}

TEST_F(MergeRowTest, ExtremeLseGaps) {
  // exp(-200) underflows fp32: the small part vanishes, nothing overflows or turns NaN.
  std::vector<float> out = Merge({0.0f, -200.0f}, {{1, 2, 3}, {-5, -5, -5}});
  EXPECT_FLOAT_EQ(out[0], 0.0f);
  EXPECT_FLOAT_EQ(out[1], 1.0f);
  out = Merge({100.0f, -100.0f}, {{1, 2, 3}, {-5, -5, -5}});
  EXPECT_FLOAT_EQ(out[0], 100.0f);
  EXPECT_FLOAT_EQ(out[3], 3.0f);
  out = Merge({-100.0f, 100.0f}, {{1, 2, 3}, {-5, -5, -5}});
  EXPECT_FLOAT_EQ(out[0], 100.0f);
  EXPECT_FLOAT_EQ(out[3], -5.0f);
  // Equal LSEs: log(2) above, plain average.
  out = Merge({80.0f, 80.0f}, {{1, 2, 3}, {3, 2, 1}});
  EXPECT_NEAR(out[0], 80.0f + std::log(2.0f), 1e-5);
  EXPECT_FLOAT_EQ(out[1], 2.0f);
  // A gap where log1p matters: lse = 50 + log1p(e^-20) rounds to 50 in fp32, O is exact-ish.
  out = Merge({50.0f, 30.0f}, {{1, 1, 1}, {0, 0, 0}});
  EXPECT_FLOAT_EQ(out[0], 50.0f);
  EXPECT_NEAR(out[1], 1.0f / (1.0f + std::exp(-20.0f)), 1e-7);
}

TEST(MergeValidationTest, RejectsBadArguments) {
  std::vector<float> o(8), lse(2);
  const PartialView part{o.data(), lse.data()};
  const auto bad = absl::StatusCode::kInvalidArgument;
  AttentionShape shape = MakeShape(2, 1, 4, true);
  EXPECT_EQ(MergePartials(shape, -1, {&part, 1}, o.data(), lse.data(), nullptr).code(), bad);
  EXPECT_EQ(MergePartials(shape, 1, {&part, 1}, nullptr, lse.data(), nullptr).code(), bad);
  const PartialView null_part{nullptr, lse.data()};
  EXPECT_EQ(MergePartials(shape, 1, {&null_part, 1}, o.data(), lse.data(), nullptr).code(), bad);
  EXPECT_EQ(MergeInto(shape, 1, o.data(), lse.data(), nullptr, lse.data(), nullptr).code(), bad);
  shape.num_kv_heads = 0;
  EXPECT_EQ(MergeInto(shape, 1, o.data(), lse.data(), o.data(), lse.data(), nullptr).code(), bad);
  shape = MakeShape(2, 1, 4, true);
  // Zero rows: nothing to read, null is fine.
  EXPECT_TRUE(MergeInto(shape, 0, nullptr, nullptr, nullptr, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace cpfill::attention
