// cpfill/launch/job/ring_report.h — how ring runs are shown: the paper's Table 5 per ring step as
// text, the same as JSON, and the units the commands print.
//
//   job.Print("%s", RingStepTable(timings, grid.cp_rank).c_str());
//   report["runs"].push_back(RingTimingsJson(timings, 4.0 * head_dim * heads));
#pragma once

#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"
#include "parallel/ring_plan.h"

namespace cpfill::launch {

std::string Ms(double seconds);    // "12.34" (milliseconds, two decimals)
std::string Bytes(int64_t bytes);  // "1.50 MiB"

// One run's steps: exchange size, transfer, compute, exposed wait and hidden chunk pairs, then
// packing, the all-gather or all-to-all and merge, and the total. `cp_rank`: whose steps.
std::string RingStepTable(const parallel::RingTimings& t, int cp_rank);

// The same as JSON; `flops_per_pair` (4 x head_dim x heads) turns visible pairs into GFLOP.
nlohmann::ordered_json RingTimingsJson(const parallel::RingTimings& t, double flops_per_pair);

}  // namespace cpfill::launch
