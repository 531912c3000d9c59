// cpfill/launch/job/trace.h — a ring run's timeline as Chrome trace-event JSON (opens in Perfetto
// and chrome://tracing): one process per rank, named by its place in the grid, one thread per lane
// (compute, exchange), one complete event per span of parallel::RingTimings.
//
//   nlohmann::ordered_json ranks = ...;   // every rank's RankSteps, gathered (world rank order)
//   json::WriteFile(path, ChromeTrace(ranks));
#pragma once

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "parallel/grid.h"
#include "parallel/ring_plan.h"

namespace cpfill::launch {

// One rank's run: its place in the grid (world_rank, node, tp_rank, cp_rank), the step table
// (RingTimingsJson), its spans and the wall-clock start that lines ranks up.
nlohmann::ordered_json RankSteps(const parallel::RingTimings& run,
                                 const parallel::ProcessGrid& grid, double flops_per_pair);

// Every rank's RankSteps in world rank order (collective; parallel::AllGatherText).
absl::StatusOr<nlohmann::ordered_json> GatherRankSteps(const parallel::RingTimings& run,
                                                       const parallel::ProcessGrid& grid,
                                                       double flops_per_pair);

// The trace of every rank's RankSteps: times in microseconds from the earliest rank's start
// (ranks on other hosts line up as well as their clocks agree).
nlohmann::ordered_json ChromeTrace(const nlohmann::ordered_json& ranks);

}  // namespace cpfill::launch
