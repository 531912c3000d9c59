#include "launch/job/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill::launch {
namespace {

// Points on both sides of a known boundary, pass-KV faster where h > 0.
std::vector<parallel::CalibrationPoint> PointsAround(double (*h)(double, double)) {
  std::vector<parallel::CalibrationPoint> points;
  for (int64_t total : {4096, 32768}) {
    for (double m : {0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0}) {
      const int64_t t = std::llround(m * static_cast<double>(total));
      points.push_back({t, total - t, std::exp(-h(static_cast<double>(t), m)), 1.0});
    }
  }
  return points;
}

double Boundary(double t, double m) { return -0.5 * std::log(t) + 2 * std::log(m) + 6; }

TEST(CalibrationHeldOut, FitsOnEveryOtherLengthAndJudgesOnTheRest) {
  const std::vector<parallel::CalibrationPoint> points = PointsAround(Boundary);
  auto held = EvaluateHeldOut(points, {.tflops = 1, .gbps = 1, .elem_bytes = 2},
                              {.num_heads = 8, .num_kv_heads = 1, .head_dim = 64}, 2);
  ASSERT_TRUE(held.ok()) << held.status();
  // Held out: every other distinct T, with all its points (T = 1638 appears twice).
  std::vector<int64_t> ts;
  for (const auto& p : points) ts.push_back(p.new_tokens);
  std::sort(ts.begin(), ts.end());
  ts.erase(std::unique(ts.begin(), ts.end()), ts.end());
  std::vector<parallel::CalibrationPoint> seen;
  size_t held_count = 0;
  for (size_t i = 0; i < points.size(); ++i) {
    const size_t rank = std::lower_bound(ts.begin(), ts.end(), points[i].new_tokens) - ts.begin();
    const bool held_out = std::count(held->held_out.begin(), held->held_out.end(), i) > 0;
    EXPECT_EQ(held_out, rank % 2 == 1) << "T=" << points[i].new_tokens;
    held_count += held_out;
    if (!held_out) seen.push_back(points[i]);
  }
  EXPECT_EQ(held_count, held->held_out.size());
  // The fit saw only the other half: it is the fit of those points, not of all.
  auto fit_seen = parallel::FitCoefficients(seen);
  ASSERT_TRUE(fit_seen.ok());
  EXPECT_EQ(held->fitted.a, fit_seen->a);
  EXPECT_EQ(held->fitted.c, fit_seen->c);
  EXPECT_NE(held->fitted.c, parallel::FitCoefficients(points)->c);
  // The boundary is learnt from half the lengths: every held-out point that is clearly on one
  // side (|h| > 0.5) is chosen right; near-ties may go either way.
  const size_t fitted = 2;  // RuleEvaluation's rules: alg1, alg5, fitted
  ASSERT_EQ(held->rules.rules[fitted], parallel::SelectorRule::kFitted);
  int clear = 0;
  for (size_t i : held->held_out) {
    const auto& p = points[i];
    const double t = static_cast<double>(p.new_tokens);
    const double h = Boundary(t, t / static_cast<double>(p.new_tokens + p.cached_tokens));
    if (std::fabs(h) < 0.5) continue;
    ++clear;
    EXPECT_EQ(held->rules.picks_kv[fitted][i], h > 0) << "T=" << p.new_tokens;
  }
  EXPECT_GE(clear, 6);
  EXPECT_EQ(RegretOn(points, held->rules.picks_kv[fitted], held->held_out).count,
            static_cast<int>(held->held_out.size()));
}

TEST(CalibrationHeldOut, RegretCountsTheSlowerChoice) {
  const std::vector<parallel::CalibrationPoint> points = {{100, 0, 1.0, 2.0}, {10, 90, 3.0, 1.0}};
  const Regret all_kv = RegretOn(points, {true, true}, {0, 1});
  EXPECT_EQ(all_kv.wrong, 1);
  EXPECT_NEAR(all_kv.regret, (1.0 + 3.0) / (1.0 + 1.0) - 1, 1e-12);
  EXPECT_EQ(RegretOn(points, {true, false}, {0, 1}).wrong, 0);
}

TEST(CalibrationHeldOut, TooFewPointsToFitIsAnError) {
  const std::vector<parallel::CalibrationPoint> points = {{100, 0, 1.0, 2.0}, {10, 90, 3.0, 1.0}};
  EXPECT_FALSE(EvaluateHeldOut(points, {}, {.num_heads = 8, .num_kv_heads = 1}, 2).ok());
}

}  // namespace
}  // namespace cpfill::launch
