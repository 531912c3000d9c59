#include "launch/job/trace.h"

#include "gtest/gtest.h"

namespace cpfill::launch {
namespace {

parallel::RingTimings OneRun(double start_unix_s) {
  parallel::RingTimings t;
  t.start_unix_s = start_unix_s;
  t.spans = {
      {.name = "pack", .lane = "compute", .start_s = 0, .duration_s = 0.001},
      {.name = "step 0 exchange", .lane = "exchange", .start_s = 0.001, .duration_s = 0.004},
      {.name = "step 0 attention", .lane = "compute", .start_s = 0.001, .duration_s = 0.003}};
  return t;
}

// Ranks line up by their wall-clock starts; spans keep their lanes and times (microseconds).
TEST(Trace, OneProcessPerRankOneThreadPerLane) {
  parallel::ProcessGrid g0, g1;
  g1.world_rank = 1;
  g1.cp_rank = 1;
  const nlohmann::ordered_json ranks = {RankSteps(OneRun(100.0), g0, 1.0),
                                        RankSteps(OneRun(100.002), g1, 1.0)};
  const nlohmann::ordered_json trace = ChromeTrace(ranks);
  ASSERT_TRUE(trace.contains("traceEvents"));
  int complete = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == 1) {
      EXPECT_EQ(e["args"]["name"], "rank 1 (node 0, TP rank 0, CP rank 1)");
    }
    if (e["ph"] != "X") continue;
    ++complete;
    const double shift = e["pid"] == 1 ? 2000.0 : 0.0;  // rank 1 began 2 ms later
    if (e["name"] == "step 0 exchange") {
      EXPECT_EQ(e["tid"], 2);
      EXPECT_NEAR(e["ts"].get<double>(), shift + 1000.0, 1e-6);
      EXPECT_NEAR(e["dur"].get<double>(), 4000.0, 1e-6);
    } else {
      EXPECT_EQ(e["tid"], 1) << e["name"];
    }
    if (e["name"] == "pack") {
      EXPECT_NEAR(e["ts"].get<double>(), shift, 1e-6);
    }
  }
  EXPECT_EQ(complete, 6);
}

}  // namespace
}  // namespace cpfill::launch
