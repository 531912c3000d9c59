#include "attention/prefix_batched.h"

#include <vector>

#include "attention/prefix_batched_test_util.h"
#include "gtest/gtest.h"

namespace cpfill::attention {
namespace {

using testing::ExpectOutputsMatch;
using testing::kNaN;
using testing::MakeShape;
using testing::MakeTreeProblem;
using testing::TreeSpec;

// A root prefix, two groups with prefixes of their own (one empty), decode rows and
// prefill-of-suffix rows, sequences without a suffix query... every row equals its sequence's
// attention over its concatenated keys, on fresh inputs with the outputs poisoned.
TEST(PrefixBatched, TreeEqualsEachSequenceOverItsConcatenatedKeys) {
  ThreadPool pool(2);
  for (const auto& [heads, kv_heads] : {std::pair{8, 1}, std::pair{8, 2}, std::pair{4, 4}}) {
    const AttentionShape shape = MakeShape(heads, kv_heads, 64, /*causal=*/true);
    const TreeSpec spec{.root = 300,
                        .groups = {{.prefix = 70, .sequences = {{1, 1}, {40, 40}, {9, 3}}},
                                   {.prefix = 0, .sequences = {{130, 65}, {1, 1}}}}};
    testing::TreeProblem t = MakeTreeProblem(shape, spec, heads * 10 + kv_heads);
    std::vector<float> o_part(t.pb.o.size(), kNaN), lse_part(t.pb.lse.size(), kNaN);
    std::fill(t.pb.o.begin(), t.pb.o.end(), kNaN);
    std::fill(t.pb.lse.begin(), t.pb.lse.end(), kNaN);
    const auto levels = t.Levels();
    ASSERT_TRUE(
        PrefixBatchedAttentionCpu(t.pb.Params(), levels, o_part.data(), lse_part.data(), &pool)
            .ok());
    ExpectOutputsMatch(shape, t.pb.q_tokens, t.pb.o.data(), t.pb.lse.data(), t.ref_o, t.ref_lse);
  }
}

TEST(PrefixBatched, RefusesKeysGivenTwiceAndMissingScratch) {
  const AttentionShape shape = MakeShape(4, 1, 64, true);
  testing::TreeProblem t = MakeTreeProblem(shape, {.root = 64, .groups = {{0, {{8, 2}}}}}, 1);
  std::vector<std::vector<SequenceSlice>> levels = t.levels;
  levels[2][0].kv_begin = 0;  // the suffix slice now covers root keys too
  std::vector<std::span<const SequenceSlice>> spans(levels.begin(), levels.end());
  absl::Status s = ValidateKvTree(t.pb.Params(), spans);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("twice"), std::string::npos) << s;
  EXPECT_FALSE(
      PrefixBatchedAttentionCpu(t.pb.Params(), t.Levels(), nullptr, nullptr, nullptr).ok());
  EXPECT_FALSE(ValidateKvTree(t.pb.Params(), {}).ok());
}

}  // namespace
}  // namespace cpfill::attention
