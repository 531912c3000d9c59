#include "parallel/selector.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "base/json_io.h"
#include "gtest/gtest.h"

namespace cpfill::parallel {
namespace {

SelectorInputs Inputs(double tflops, double gbps, int heads, int kv_heads, int cp_size,
                      int64_t new_tokens, int64_t cached_tokens) {
  SelectorInputs in;
  in.system = {.tflops = tflops, .gbps = gbps, .elem_bytes = 2};
  in.model = {.num_heads = heads, .num_kv_heads = kv_heads, .head_dim = 128};
  in.cp_size = cp_size;
  in.new_tokens = new_tokens;
  in.cached_tokens = cached_tokens;
  return in;
}

Selection MustSelect(const SelectorInputs& in, SelectorRule rule,
                     const FittedCoefficients& fitted = FittedCoefficients::Paper()) {
  absl::StatusOr<Selection> s = Select(in, rule, fitted);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : Selection{};
}

// Table 4 of the paper: P + T = 128000 on CP4, TTFT in ms.
struct Table4Row {
  int64_t p, t;
  double pass_kv_ms, pass_q_ms;
};
constexpr Table4Row kTable4[] = {
    {126720, 1280, 1023.39, 898.71},    {124800, 3200, 1110.18, 1046.43},
    {123840, 4160, 1298.92, 1280.1},    {121600, 6400, 1305.56, 1302.01},
    {115200, 12800, 2080.67, 2205.27},  {102400, 25600, 3353.02, 3617.02},
    {89600, 38400, 4629.23, 4922.52},   {76800, 51200, 5745.08, 6217.83},
    {64000, 64000, 6845.21, 7367.99},   {51200, 76800, 7890.35, 8468.66},
    {38400, 89600, 8697.27, 9666.62},   {25600, 102400, 10105.78, 10652.39},
    {12800, 115200, 11136.4, 11571.62}, {0, 128000, 11462.15, 12360.57},
};

TEST(SelectorNames, ParseAndPrint) {
  for (RingAlgorithm a :
       {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ, RingAlgorithm::kAllGather}) {
    EXPECT_EQ(*ParseRingAlgorithm(RingAlgorithmName(a)), a);
  }
  for (SelectorRule r : {SelectorRule::kAlg1, SelectorRule::kAlg5, SelectorRule::kFitted}) {
    EXPECT_EQ(*ParseSelectorRule(SelectorRuleName(r)), r);
  }
  absl::StatusOr<RingAlgorithm> bad = ParseRingAlgorithm("pass_kv");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("pass-kv, pass-q, all-gather"), std::string::npos);
  absl::StatusOr<SelectorRule> bad_rule = ParseSelectorRule("alg2");
  EXPECT_EQ(bad_rule.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_rule.status().message().find("alg1, alg5, fitted"), std::string::npos);
}

// Eq. 2 by hand: N=4, C=800 TFLOP/s, N_KV/N_H=1/16, e=2, BW=50 GB/s:
// 4 * 800e12 * 2 / (2 * 16 * 50e9) = 4000 tokens.
TEST(SelectorAlg1, NewTokenThresholdMatchesHandComputation) {
  const Selection at = MustSelect(Inputs(800, 50, 16, 1, 4, 4000, 1000000), SelectorRule::kAlg1);
  EXPECT_DOUBLE_EQ(at.new_tokens_threshold, 4000);
  EXPECT_EQ(at.choice, RingAlgorithm::kPassKV);  // T >= threshold: a tie goes to pass-KV
  EXPECT_EQ(at.reason,
            "T=4000 >= N*C*N_KV*e/(2*N_H*BW)=4000 -> pass-kv (KV exchange hides under "
            "attention)");
  const Selection below = MustSelect(Inputs(800, 50, 16, 1, 4, 3999, 1000000), SelectorRule::kAlg1);
  EXPECT_EQ(below.choice, RingAlgorithm::kPassQ);
  // Same ratio with the whole model's heads (128/8) gives the same threshold.
  const Selection model =
      MustSelect(Inputs(800, 50, 128, 8, 4, 3999, 1000000), SelectorRule::kAlg1);
  EXPECT_DOUBLE_EQ(model.new_tokens_threshold, 4000);
  EXPECT_EQ(model.choice, RingAlgorithm::kPassQ);
}

// §4.2.4: on CP4, Llama-3-405B, every Table 4 point with miss rate >= 12.5% = 2*N_KV/N_H
// selects pass-KV by eq. 1, whatever C and BW are; Alg. 5 only lowers that threshold.
TEST(SelectorAlg1, Table4AboveEighthMissRateIsPassKvForAnySystem) {
  int checked = 0;
  for (const auto& [heads, kv_heads] : {std::pair{128, 8}, std::pair{16, 1}}) {
    for (double tflops : {50.0, 400.0, 800.0, 5000.0}) {
      for (double gbps : {0.5, 3.0, 50.0, 400.0}) {
        for (const Table4Row& row : kTable4) {
          const SelectorInputs in = Inputs(tflops, gbps, heads, kv_heads, 4, row.t, row.p);
          const Selection alg1 = MustSelect(in, SelectorRule::kAlg1);
          EXPECT_DOUBLE_EQ(alg1.miss_rate_threshold, 0.125);
          if (alg1.miss_rate < 0.125) continue;
          ++checked;
          EXPECT_EQ(alg1.choice, RingAlgorithm::kPassKV) << alg1.reason;
          EXPECT_EQ(MustSelect(in, SelectorRule::kAlg5).choice, RingAlgorithm::kPassKV);
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 4 * 4 * 9);  // the 9 rows from 20% to 100%
}

TEST(SelectorAlg1, ReasonNamesTheDecidingMissRateCondition) {
  // T below eq. 2's threshold (N*C*N_KV*e/(2*N_H*BW) = 66666.7), miss rate 20% >= 12.5%.
  const Selection s = MustSelect(Inputs(800, 3, 128, 8, 4, 25600, 102400), SelectorRule::kAlg1);
  EXPECT_EQ(s.choice, RingAlgorithm::kPassKV);
  EXPECT_EQ(s.reason,
            "T=25600 < N*C*N_KV*e/(2*N_H*BW)=66666.7 but miss rate 20.00% >= 2*N_KV/N_H=12.50% "
            "-> pass-kv");
}

// Eq. 5: threshold = 2*N_KV/N_H - 4*T*BW/(N*C*e). The header's example, by hand:
// 0.125 - 4*6400*3e9/(4*800e12*2) = 0.125 - 0.012 = 0.113.
TEST(SelectorAlg5, LowersMissRateThresholdByAllToAllTerm) {
  const SelectorInputs in = Inputs(800, 3, 128, 8, 4, 6400, 121600);
  const Selection s = MustSelect(in, SelectorRule::kAlg5);
  EXPECT_NEAR(s.miss_rate_threshold, 0.113, 1e-15);
  EXPECT_NEAR(s.new_tokens_threshold, 66666.666666666667, 1e-9);
  EXPECT_DOUBLE_EQ(s.miss_rate, 0.05);
  EXPECT_EQ(s.choice, RingAlgorithm::kPassQ);
  EXPECT_EQ(s.reason,
            "T=6400 < N*C*N_KV*e/(2*N_H*BW)=66666.7 and miss rate 5.00% < "
            "2*N_KV/N_H - 4*T*BW/(N*C*e)=11.30% -> pass-q");

  // 0.125 - 4*1280*50e9/(4*800e12*2) = 0.085: a 10% miss rate with T=1280 is pass-Q under
  // Alg. 1 but pass-KV under Alg. 5.
  const SelectorInputs mid = Inputs(800, 50, 16, 1, 4, 1280, 11520);
  const Selection alg5 = MustSelect(mid, SelectorRule::kAlg5);
  EXPECT_NEAR(alg5.miss_rate_threshold, 0.085, 1e-15);
  EXPECT_EQ(alg5.choice, RingAlgorithm::kPassKV);
  EXPECT_EQ(MustSelect(mid, SelectorRule::kAlg1).choice, RingAlgorithm::kPassQ);
}

TEST(SelectorRules, DecodeIsPassQ) {
  const SelectorInputs in = Inputs(800, 50, 128, 8, 4, 1, 1000000);
  EXPECT_EQ(MustSelect(in, SelectorRule::kAlg1).choice, RingAlgorithm::kPassQ);
  EXPECT_EQ(MustSelect(in, SelectorRule::kAlg5).choice, RingAlgorithm::kPassQ);
  EXPECT_EQ(MustSelect(in, SelectorRule::kFitted).choice, RingAlgorithm::kPassQ);
}

TEST(SelectorRules, FullPrefillWithGqaIsPassKv) {
  for (const auto& [heads, kv_heads] : {std::pair{128, 8}, std::pair{32, 8}, std::pair{64, 8}}) {
    for (int64_t t : {1, 100, 4096, 1000000}) {
      for (double gbps : {0.1, 50.0}) {
        const SelectorInputs in = Inputs(800, gbps, heads, kv_heads, 8, t, 0);
        EXPECT_EQ(MustSelect(in, SelectorRule::kAlg1).choice, RingAlgorithm::kPassKV) << t;
        EXPECT_EQ(MustSelect(in, SelectorRule::kAlg5).choice, RingAlgorithm::kPassKV) << t;
      }
    }
  }
}

// h = -1.059 ln T + 1.145 ln(T/(T+P)) + 12.112, values computed separately.
TEST(SelectorFitted, PaperCoefficientsByHand) {
  const struct {
    int64_t t, p;
    double h;
  } cases[] = {{6400, 121600, -0.5992458654586006},
               {1280, 126720, -0.7376575259279328},
               {128000, 0, -0.34161288993295713}};
  for (const auto& c : cases) {
    // The fitted rule needs no C or BW.
    const Selection s = MustSelect(Inputs(0, 0, 128, 8, 4, c.t, c.p), SelectorRule::kFitted);
    EXPECT_NEAR(s.h, c.h, 1e-12) << c.t;
    EXPECT_EQ(s.choice, RingAlgorithm::kPassQ);
  }
  // Small T and a high miss rate: positive.
  FittedCoefficients custom{.a = -1, .b = 1, .c = 5, .source = "test"};
  const Selection s = MustSelect(Inputs(0, 0, 128, 8, 4, 100, 0), SelectorRule::kFitted, custom);
  EXPECT_NEAR(s.h, 5 - std::log(100.0), 1e-12);
  EXPECT_EQ(s.choice, RingAlgorithm::kPassKV);
  EXPECT_NE(s.reason.find("> 0 -> pass-kv (coefficients: test)"), std::string::npos) << s.reason;
}

TEST(SelectorRules, RejectsInvalidInputs) {
  const SelectorInputs good = Inputs(800, 50, 128, 8, 4, 1000, 1000);
  ASSERT_TRUE(Select(good, SelectorRule::kAlg1, {}).ok());
  std::vector<SelectorInputs> bad(9, good);
  bad[0].new_tokens = 0;
  bad[1].cached_tokens = -1;
  bad[2].cp_size = 0;
  bad[3].model.num_heads = 0;
  bad[4].model.num_kv_heads = -8;
  bad[5].model.num_heads = 12, bad[5].model.num_kv_heads = 5;
  bad[6].system.elem_bytes = 0;
  bad[7].system.tflops = 0;
  bad[8].system.gbps = -1;
  for (size_t i = 0; i < bad.size(); ++i) {
    for (SelectorRule rule : {SelectorRule::kAlg1, SelectorRule::kAlg5, SelectorRule::kFitted}) {
      absl::StatusOr<Selection> s = Select(bad[i], rule, {});
      if (rule == SelectorRule::kFitted && i >= 7) {
        EXPECT_TRUE(s.ok()) << i << ": the fitted rule needs no C or BW";
      } else {
        EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << i;
      }
    }
  }
  absl::StatusOr<Selection> s = Select(bad[5], SelectorRule::kAlg1, {});
  EXPECT_NE(s.status().message().find("N_H (12) is not divisible by N_KV (5)"), std::string::npos);
}

TEST(SelectorPredict, RooflineByHand) {
  // Llama-3-405B per GPU on TP8 (16 query heads, 1 KV head, D = 2048), CP4, T=3200, P=124800,
  // C = 500 TFLOP/s, BW = 25 GB/s, e = 2.
  const SelectorInputs in = Inputs(500, 25, 16, 1, 4, 3200, 124800);
  const PredictedTimes p = Predict(in);
  // 4*3200*2048*128000 / (16 * 500e12)
  EXPECT_NEAR(p.pass_kv_compute_s, 0.0004194304, 1e-15);
  EXPECT_EQ(p.pass_q_compute_s, p.pass_kv_compute_s);
  // 2 * 32000 * 2048 * 2 / 16 / 25e9
  EXPECT_NEAR(p.pass_kv_exchange_s, 0.00065536, 1e-15);
  // 800 * 2048 * 2 / 25e9
  EXPECT_NEAR(p.pass_q_exchange_s, 0.000131072, 1e-15);
  // 3 * 800 * (2048 + 16) * 4 / 25e9
  EXPECT_NEAR(p.pass_q_all_to_all_s, 0.000792576, 1e-15);
  // 4 * compute + 3 * (exchange - compute)
  EXPECT_NEAR(p.pass_kv_total_s, 0.0023855104, 1e-15);
  // 4 * compute (exchange hidden) + all-to-all
  EXPECT_NEAR(p.pass_q_total_s, 0.0024702976, 1e-15);
}

TEST(SelectorPredict, OneRankCommunicatesNothing) {
  const PredictedTimes p = Predict(Inputs(500, 25, 16, 1, 1, 3200, 124800));
  const double compute = 4.0 * 3200 * 2048 * 128000 / 500e12;
  EXPECT_NEAR(p.pass_kv_compute_s, compute, 1e-15);
  EXPECT_EQ(p.pass_kv_exchange_s, 0);
  EXPECT_EQ(p.pass_q_exchange_s, 0);
  EXPECT_EQ(p.pass_q_all_to_all_s, 0);
  EXPECT_EQ(p.pass_kv_total_s, p.pass_kv_compute_s);
  EXPECT_EQ(p.pass_q_total_s, p.pass_q_compute_s);
}

TEST(SelectorPredict, UnknownSystemGivesNullPredictions) {
  const PredictedTimes p = Predict(Inputs(0, 0, 16, 1, 4, 3200, 124800));
  EXPECT_TRUE(std::isnan(p.pass_kv_total_s));
  const Selection s = MustSelect(Inputs(0, 0, 16, 1, 4, 3200, 124800), SelectorRule::kFitted);
  EXPECT_TRUE(s.ToJson()["predicted"]["pass_kv_total_s"].is_null()) << s.ToJson();
  EXPECT_NE(json::Dump(s.ToJson())->find("\"pass_kv_total_s\":null"), std::string::npos);
}

TEST(SelectorJson, HasEveryField) {
  const Selection s = MustSelect(Inputs(800, 3, 128, 8, 4, 6400, 121600), SelectorRule::kAlg5);
  // Through text, as `cpfill select` prints it and a reader parses it.
  absl::StatusOr<nlohmann::json> v = json::Parse(*json::Dump(s.ToJson()));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*json::GetString(*v, "choice"), "pass-q");
  EXPECT_EQ(*json::GetString(*v, "rule"), "alg5");
  EXPECT_EQ(*json::GetString(*v, "reason"), s.reason);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "miss_rate"), 0.05);
  EXPECT_EQ(*json::GetInt(*v, "new_tokens"), 6400);
  EXPECT_EQ(*json::GetInt(*v, "cached_tokens"), 121600);
  EXPECT_EQ(*json::GetInt(*v, "cp_size"), 4);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "new_tokens_threshold"), s.new_tokens_threshold);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "miss_rate_threshold"), s.miss_rate_threshold);
  for (const char* key : {"h", "a", "b", "c", "coefficients_source"}) {
    ASSERT_NE(json::Find(*v, key), nullptr) << key;
    EXPECT_TRUE(json::Find(*v, key)->is_null()) << key;
  }
  const nlohmann::json* predicted = json::Find(*v, "predicted");
  ASSERT_NE(predicted, nullptr);
  EXPECT_EQ(predicted->size(), 7u);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*predicted, "pass_q_all_to_all_s"),
                   s.predicted.pass_q_all_to_all_s);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*predicted, "pass_kv_total_s"), s.predicted.pass_kv_total_s);

  const Selection f = MustSelect(Inputs(800, 3, 128, 8, 4, 6400, 121600), SelectorRule::kFitted);
  v = json::Parse(*json::Dump(f.ToJson()));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*json::GetString(*v, "rule"), "fitted");
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "h"), f.h);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "a"), -1.059);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "b"), 1.145);
  EXPECT_DOUBLE_EQ(*json::GetNumber(*v, "c"), 12.112);
  EXPECT_EQ(*json::GetString(*v, "coefficients_source"), "paper (App. D)");
  EXPECT_TRUE(json::Find(*v, "new_tokens_threshold")->is_null());
}

// Synthetic grid with a known boundary h* = -ln T + 1.2 ln m + 10: pass-KV is exp(h*) times
// faster where h* > 0. The fit must put every point on the right side.
TEST(SelectorFit, RecoversKnownBoundary) {
  std::vector<CalibrationPoint> points;
  auto truth = [](double t, double m) { return -std::log(t) + 1.2 * std::log(m) + 10; };
  for (int64_t t = 256; t <= 262144; t *= 2) {
    for (double m : {0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0}) {
      const double h = truth(static_cast<double>(t), m);
      if (std::fabs(h) < 0.2) continue;  // keep a margin: the test is about signs
      const int64_t p = std::llround(static_cast<double>(t) / m) - t;
      points.push_back({t, p, 1.0 * std::exp(-h), 1.0});
    }
  }
  ASSERT_GT(points.size(), 50u);
  absl::StatusOr<FittedCoefficients> fit = FitCoefficients(points);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_LT(fit->a, 0);
  EXPECT_GT(fit->b, 0);
  EXPECT_NE(fit->source.find("calibration points"), std::string::npos);
  for (const CalibrationPoint& p : points) {
    const double t = static_cast<double>(p.new_tokens);
    const double m = t / (t + static_cast<double>(p.cached_tokens));
    const double h = fit->a * std::log(t) + fit->b * std::log(m) + fit->c;
    EXPECT_EQ(h > 0, truth(t, m) > 0) << "T=" << p.new_tokens << " P=" << p.cached_tokens;
  }
}

// Table 4 itself: the fit must agree with every point where the two algorithms differ by more
// than 2% (the 3.25% and 5% rows are near-ties that weigh almost nothing).
TEST(SelectorFit, FitsTable4) {
  std::vector<CalibrationPoint> points;
  for (const Table4Row& row : kTable4) {
    points.push_back({row.t, row.p, row.pass_kv_ms / 1e3, row.pass_q_ms / 1e3});
  }
  absl::StatusOr<FittedCoefficients> fit = FitCoefficients(points);
  ASSERT_TRUE(fit.ok()) << fit.status();
  for (const Table4Row& row : kTable4) {
    if (std::fabs(std::log(row.pass_kv_ms / row.pass_q_ms)) < 0.02) continue;
    const Selection s =
        MustSelect(Inputs(0, 0, 128, 8, 4, row.t, row.p), SelectorRule::kFitted, *fit);
    EXPECT_EQ(s.choice,
              row.pass_kv_ms < row.pass_q_ms ? RingAlgorithm::kPassKV : RingAlgorithm::kPassQ)
        << "T=" << row.t << " h=" << s.h;
  }
}

TEST(SelectorFit, RejectsBadPoints) {
  const CalibrationPoint ok{1000, 1000, 1.0, 2.0};
  EXPECT_EQ(FitCoefficients({ok, ok}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FitCoefficients({ok, ok, {1000, 1000, 0.0, 1.0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FitCoefficients({ok, ok, {1000, 1000, 1.0, -1.0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FitCoefficients({ok, ok, {0, 1000, 1.0, 1.0}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const CalibrationPoint tie{1000, 1000, 1.0, 1.0};
  EXPECT_EQ(FitCoefficients({tie, tie, tie}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SelectorCalibrationFile, RoundTrips) {
  CalibrationFile file;
  file.fitted = {.a = -0.9, .b = 1.3, .c = 10.25, .source = "calibrate on 4 nodes"};
  file.tflops = 512.5;
  file.gbps = 24;
  file.elem_bytes = 2;
  file.points = {{1280, 126720, 0.9, 0.8}, {128000, 0, 11.4, 12.3}};
  file.made_on = RingContext{
      .backend = "cuda", .cp_size = 4, .tp_size = 8, .num_nodes = 4, .link = "nccl across nodes"};
  const std::string path = ::testing::TempDir() + "/selector_calibration.json";
  ASSERT_TRUE(WriteCalibrationFile(path, file).ok());
  absl::StatusOr<CalibrationFile> back = ReadCalibrationFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->fitted.a, -0.9);
  EXPECT_EQ(back->fitted.b, 1.3);
  EXPECT_EQ(back->fitted.c, 10.25);
  EXPECT_EQ(back->fitted.source, "calibrate on 4 nodes");
  EXPECT_EQ(back->tflops, 512.5);
  EXPECT_EQ(back->gbps, 24);
  EXPECT_EQ(back->elem_bytes, 2);
  ASSERT_EQ(back->points.size(), 2u);
  EXPECT_EQ(back->points[0].new_tokens, 1280);
  EXPECT_EQ(back->points[0].cached_tokens, 126720);
  EXPECT_EQ(back->points[1].pass_kv_s, 11.4);
  EXPECT_EQ(back->points[1].pass_q_s, 12.3);
  ASSERT_TRUE(back->made_on.has_value());
  EXPECT_TRUE(Differences(*file.made_on, *back->made_on).empty());
  EXPECT_EQ(back->made_on->link, "nccl across nodes");
}

TEST(SelectorCalibrationFile, DifferencesNameEachField) {
  const RingContext fit{
      .backend = "cuda", .cp_size = 2, .tp_size = 1, .num_nodes = 2, .link = "nccl across nodes"};
  EXPECT_TRUE(Differences(fit, fit).empty());
  RingContext run = fit;
  run.cp_size = 4;
  run.link = "nccl across nodes, NCCL_P2P_DISABLE=1";
  EXPECT_EQ(Differences(fit, run),
            (std::vector<std::string>{"CP 2 (the fit) vs 4 (this run)",
                                      "link 'nccl across nodes' (the fit) vs 'nccl across nodes, "
                                      "NCCL_P2P_DISABLE=1' (this run)"}));
  run = fit;
  run.backend = "cpu";
  run.tp_size = 2;
  EXPECT_EQ(Differences(fit, run),
            (std::vector<std::string>{"backend cuda (the fit) vs cpu (this run)",
                                      "TP 1 (the fit) vs 2 (this run)"}));
}

// Rescaled from CP2 to CP4 at a quarter of the bandwidth, the fitted boundary sits at 8x the new
// tokens (the eq. 2 threshold N*C/BW grew 8x) for every miss rate.
TEST(SelectorFit, RescaleMovesTheBoundaryWithTheEq2Threshold) {
  CalibrationFile file;
  file.fitted = {.a = -1.0, .b = 1.2, .c = 10, .source = "calibrate"};
  file.tflops = 300;
  file.gbps = 40;
  file.made_on = RingContext{
      .backend = "cuda", .cp_size = 2, .tp_size = 1, .num_nodes = 2, .link = "nccl across nodes"};
  const FittedCoefficients moved = RescaleFit(file, 4, {.tflops = 300, .gbps = 10});
  EXPECT_EQ(moved.a, file.fitted.a);
  EXPECT_EQ(moved.b, file.fitted.b);
  EXPECT_NE(moved.source.find("rescaled to CP4"), std::string::npos) << moved.source;
  for (double m : {0.01, 0.1, 1.0}) {
    // h = 0 at ln T = -(b ln m + c) / a.
    const double t_fit = std::exp(-(file.fitted.b * std::log(m) + file.fitted.c) / file.fitted.a);
    const double t_run = std::exp(-(moved.b * std::log(m) + moved.c) / moved.a);
    EXPECT_NEAR(t_run / t_fit, 8.0, 1e-9) << "miss rate " << m;
  }
  // A fit made on fp32 (e = 4) used on bf16 (e = 2): the threshold halves.
  file.elem_bytes = 4;
  const FittedCoefficients bf16 = RescaleFit(file, 2, {.tflops = 300, .gbps = 40, .elem_bytes = 2});
  EXPECT_NEAR(bf16.c, file.fitted.c - file.fitted.a * std::log(0.5), 1e-12);
  file.elem_bytes = 0;
  // Unknown C or BW on either side: only the CP size moves it.
  const FittedCoefficients cp_only = RescaleFit(file, 4, {.tflops = 0, .gbps = 0});
  EXPECT_NEAR(cp_only.c, file.fitted.c - file.fitted.a * std::log(2.0), 1e-12);
}

void WriteText(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

TEST(SelectorCalibrationFile, ErrorsNameThePathAndKey) {
  const std::string path = ::testing::TempDir() + "/selector_calibration_bad.json";
  WriteText(path, R"({"a": 1, "c": 2})");
  absl::StatusOr<CalibrationFile> f = ReadCalibrationFile(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find(path), std::string::npos) << f.status();
  EXPECT_NE(f.status().message().find("missing key \"b\""), std::string::npos) << f.status();

  WriteText(path, R"({"a": 1, "b": 2, "c": 3})");  // minimal file: defaults elsewhere
  f = ReadCalibrationFile(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tflops, 0);
  EXPECT_TRUE(f->points.empty());
  EXPECT_NE(f->fitted.source.find(path), std::string::npos);

  WriteText(path, R"({"a": 1, "b": 2, "c": 3, "points": [{"new_tokens": 5, "cached_tokens": 0,
                      "pass_kv_s": 1, "pass_q_s": 2}, {"new_tokens": 5, "cached_tokens": 0,
                      "pass_kv_s": 1}]})");
  f = ReadCalibrationFile(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("points[1]: json: missing key \"pass_q_s\""),
            std::string::npos)
      << f.status();

  WriteText(path, R"({"rule": "alg1", "a": 1, "b": 2, "c": 3})");
  EXPECT_EQ(ReadCalibrationFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  WriteText(path, R"({"a": "1", "b": 2, "c": 3})");
  f = ReadCalibrationFile(path);
  EXPECT_NE(f.status().message().find("\"a\" is a string, expected a number"), std::string::npos)
      << f.status();
  WriteText(path, R"({"a": 1, "b": 2, "c": 3, "a": 4})");  // which "a"? refused, not guessed
  f = ReadCalibrationFile(path);
  EXPECT_NE(f.status().message().find("\"a\" appears twice"), std::string::npos) << f.status();
  WriteText(path, R"({"a": 1, "b": 2, "c": 3, "points": [{"new_tokens": 5.5, "cached_tokens": 0,
                      "pass_kv_s": 1, "pass_q_s": 2}]})");
  f = ReadCalibrationFile(path);
  EXPECT_NE(f.status().message().find("points[0]: json: key \"new_tokens\" is 5.5"),
            std::string::npos)
      << f.status();
  WriteText(path, R"({"a": 1, "b": 2, "c": 3,})");
  f = ReadCalibrationFile(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find(path), std::string::npos) << f.status();

  std::remove(path.c_str());
  EXPECT_EQ(ReadCalibrationFile(path).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace cpfill::parallel
