#include "runtime/model/sampling.h"

#include <cmath>
#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

// Logits whose softmax is exactly `probs`.
std::vector<float> LogitsOf(const std::vector<double>& probs) {
  std::vector<float> z;
  for (double p : probs) z.push_back(static_cast<float>(std::log(p)));
  return z;
}

// How often each id comes out of `n` draws at steps 0..n-1.
std::map<int32_t, int> Draw(const std::vector<float>& z, const SamplingParams& p, int n) {
  std::map<int32_t, int> count;
  for (int step = 0; step < n; ++step) ++count[SampleToken(z, p, step).id];
  return count;
}

TEST(Sampling, GreedyIsTheArgmaxAndTheLowestIdOnATie) {
  EXPECT_EQ(SampleToken(std::vector<float>{0.5f, 3.0f, -1.0f, 3.0f}, {}, 0).id, 1);
  SamplingParams top1{.temperature = 1.0, .top_k = 1, .seed = 5};
  EXPECT_EQ(SampleToken(std::vector<float>{0.5f, 2.0f, 9.0f}, top1, 7).id, 2);
}

TEST(Sampling, FollowsTheSoftmaxAtTheTemperature) {
  const std::vector<double> probs = {0.5, 0.25, 0.15, 0.1};
  const std::vector<float> z = LogitsOf(probs);
  constexpr int kDraws = 20000;
  for (double temperature : {1.0, 0.5}) {
    SamplingParams p{.temperature = temperature, .seed = 11};
    std::vector<double> want(probs.size());
    double total = 0;
    for (size_t i = 0; i < probs.size(); ++i)
      total += want[i] = std::pow(probs[i], 1 / temperature);
    const auto count = Draw(z, p, kDraws);
    for (size_t i = 0; i < probs.size(); ++i) {
      const double expected = want[i] / total;
      const double got = count.count(i) ? double(count.at(i)) / kDraws : 0.0;
      // 5 standard deviations of a binomial proportion.
      EXPECT_NEAR(got, expected, 5 * std::sqrt(expected * (1 - expected) / kDraws))
          << "temperature " << temperature << " token " << i;
    }
  }
}

TEST(Sampling, TopKAndTopPKeepOnlyTheMostLikely) {
  const std::vector<float> z = LogitsOf({0.05, 0.5, 0.3, 0.15});
  auto k2 = Draw(z, {.temperature = 1.0, .top_k = 2, .seed = 3}, 2000);
  EXPECT_EQ(k2.size(), 2u);
  EXPECT_TRUE(k2.count(1) && k2.count(2));
  // 0.5 + 0.3 reaches 0.7: tokens 1 and 2 only; 0.85 needs token 3 too.
  auto p7 = Draw(z, {.temperature = 1.0, .top_p = 0.7, .seed = 3}, 2000);
  EXPECT_EQ(p7.size(), 2u);
  EXPECT_TRUE(p7.count(1) && p7.count(2));
  auto p85 = Draw(z, {.temperature = 1.0, .top_p = 0.85, .seed = 3}, 2000);
  EXPECT_EQ(p85.size(), 3u);
  EXPECT_FALSE(p85.count(0));
}

TEST(Sampling, TiesAtTheTopKCutAreKeptByLowerId) {
  // Three tokens tie for second place; top_k 2 keeps the first of them (id 1) beside id 4.
  const std::vector<float> z = {0.0f, 2.0f, 2.0f, 2.0f, 3.0f};
  auto k2 = Draw(z, {.temperature = 1.0, .top_k = 2, .seed = 8}, 2000);
  EXPECT_EQ(k2.size(), 2u);
  EXPECT_TRUE(k2.count(1) && k2.count(4));
}

TEST(Sampling, TopPOverALargeVocabularyPastTheFirstPass) {
  // 4096 equally likely tokens: top_p 0.5 must keep 2048 of them, more than the first pass.
  const std::vector<float> z(4096, 0.0f);
  auto kept = Draw(z, {.temperature = 1.0, .top_p = 0.5, .seed = 9}, 3000);
  EXPECT_GT(kept.size(), 1000u);
  for (const auto& [id, n] : kept) EXPECT_LT(id, 2048) << "outside the nucleus";
}

TEST(Sampling, TheSameSeedAndStepGiveTheSameToken) {
  const std::vector<float> z = LogitsOf({0.3, 0.3, 0.2, 0.2});
  SamplingParams a{.temperature = 1.0, .seed = 1234}, b = a;
  b.seed = 4321;
  int same_seed_differs = 0, other_seed_differs = 0;
  for (int step = 0; step < 200; ++step) {
    same_seed_differs += SampleToken(z, a, step).id != SampleToken(z, a, step).id;
    other_seed_differs += SampleToken(z, a, step).id != SampleToken(z, b, step).id;
  }
  EXPECT_EQ(same_seed_differs, 0);
  EXPECT_GT(other_seed_differs, 50);
}

TEST(Sampling, LogprobsAreTheModelsLogSoftmax) {
  const std::vector<double> probs = {0.1, 0.6, 0.3};
  SamplingParams p{.logprobs = 2};
  SampledToken t = SampleToken(LogitsOf(probs), p, 0);
  EXPECT_EQ(t.id, 1);
  EXPECT_NEAR(t.logprob, std::log(0.6), 1e-6);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 2);
  EXPECT_NEAR(t.top[1].second, std::log(0.3), 1e-6);
}

TEST(Sampling, BadParamsAreRefusedNamingTheField) {
  auto message = [](const SamplingParams& p) {
    return std::string(ValidateSampling(p, 100).message());
  };
  EXPECT_TRUE(ValidateSampling({}, 100).ok());
  EXPECT_NE(message({.temperature = -1}).find("temperature"), std::string::npos);
  EXPECT_NE(message({.temperature = NAN}).find("temperature"), std::string::npos);
  EXPECT_NE(message({.top_k = -2}).find("top_k"), std::string::npos);
  EXPECT_NE(message({.top_p = 0}).find("top_p"), std::string::npos);
  EXPECT_NE(message({.top_p = 1.5}).find("top_p"), std::string::npos);
  EXPECT_NE(message({.logprobs = 21}).find("logprobs"), std::string::npos);
}

}  // namespace
}  // namespace cpfill::runtime
