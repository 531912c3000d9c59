// Prompt logprobs merged from vocabulary slices equal the log-softmax of the whole row.
#include "runtime/model/prompt_logprobs.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

TEST(PromptLogprobs, SlicesMergeToTheWholeRowsLogSoftmax) {
  constexpr int kVocab = 12, kSlices = 3, kK = 2;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 3);
  const std::vector<int32_t> tokens = {4, 11, 0};  // rows 0 and 1 score tokens 11 and 0
  std::vector<std::vector<float>> rows(2, std::vector<float>(kVocab));
  for (auto& row : rows) {
    for (float& x : row) x = normal(rng);
  }
  std::vector<double> records;
  for (int slice = kSlices - 1; slice >= 0; --slice) {  // any order
    for (int p = 0; p < 2; ++p) {
      const int64_t width = kVocab / kSlices;
      AppendSliceScores(std::span<const float>(rows[p]).subspan(slice * width, width),
                        slice * width, 0, p, tokens[p + 1], kK, &records);
    }
  }
  ASSERT_EQ(records.size(), static_cast<size_t>(2 * kSlices * SliceScoreWords(kK)));
  std::vector<SequenceOutput> out(1);
  const std::vector<PrefillRequest> batch = {{.tokens = tokens, .prompt_logprobs = kK}};
  ASSERT_TRUE(MergeSliceScores(records, batch, {0}, &out).ok());
  ASSERT_EQ(out[0].prompt_logprobs.size(), 2u);
  for (int p = 0; p < 2; ++p) {
    double sum = 0;
    for (const float x : rows[p]) sum += std::exp(double(x));
    const double lse = std::log(sum);
    const SampledToken& t = out[0].prompt_logprobs[p];
    EXPECT_EQ(t.id, tokens[p + 1]);
    EXPECT_NEAR(t.logprob, rows[p][tokens[p + 1]] - lse, 1e-9);
    ASSERT_EQ(t.top.size(), static_cast<size_t>(kK));
    const int best = std::max_element(rows[p].begin(), rows[p].end()) - rows[p].begin();
    EXPECT_EQ(t.top[0].first, best);
    EXPECT_NEAR(t.top[0].second, rows[p][best] - lse, 1e-9);
    EXPECT_GE(t.top[0].second, t.top[1].second);
  }
  // A record of a sequence that asked none is a broken invariant, not a silent drop.
  const std::vector<PrefillRequest> none = {{.tokens = tokens}};
  std::vector<SequenceOutput> unused(1);
  EXPECT_TRUE(absl::IsInternal(MergeSliceScores(records, none, {0}, &unused)));
}

// A slice with no finite logit (an empty one, or all -inf) merged first adds no mass and leaves
// no NaN; the top k kept across many slices are the best k of all of them.
TEST(PromptLogprobs, EmptySliceAndManySlicesMerge) {
  const std::vector<int32_t> tokens = {0, 5};
  const std::vector<float> row = {0.5f, -1.0f, 2.0f, 1.0f, 3.0f, -2.0f, 0.0f, 1.5f};
  std::vector<double> records;
  AppendSliceScores(std::span<const float>(), 0, 0, 0, tokens[1], 2, &records);
  for (int slice = 0; slice < 4; ++slice) {
    AppendSliceScores(std::span<const float>(row).subspan(slice * 2, 2), slice * 2, 0, 0, tokens[1],
                      2, &records);
  }
  std::vector<SequenceOutput> out(1);
  const std::vector<PrefillRequest> batch = {{.tokens = tokens, .prompt_logprobs = 2}};
  ASSERT_TRUE(MergeSliceScores(records, batch, {0}, &out).ok());
  ASSERT_EQ(out[0].prompt_logprobs.size(), 1u);
  double sum = 0;
  for (const float x : row) sum += std::exp(double(x));
  const SampledToken& t = out[0].prompt_logprobs[0];
  EXPECT_NEAR(t.logprob, row[5] - std::log(sum), 1e-9);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].first, 4);
  EXPECT_EQ(t.top[1].first, 2);
}

}  // namespace
}  // namespace cpfill::runtime
