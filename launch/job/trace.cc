#include "launch/job/trace.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/job/ring_report.h"

namespace cpfill::launch {
namespace {

// Trace viewers number threads; the lanes keep one order on every rank.
int LaneId(const std::string& lane) { return lane == "compute" ? 1 : 2; }

nlohmann::ordered_json Metadata(const char* what, int pid, int tid, const std::string& name) {
  return {{"name", what}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

}  // namespace

nlohmann::ordered_json RankSteps(const parallel::RingTimings& run,
                                 const parallel::ProcessGrid& grid, double flops_per_pair) {
  nlohmann::ordered_json out = {{"world_rank", grid.world_rank},
                                {"node", grid.node},
                                {"tp_rank", grid.tp_rank},
                                {"cp_rank", grid.cp_rank},
                                {"start_unix_s", run.start_unix_s}};
  out.update(RingTimingsJson(run, flops_per_pair));
  nlohmann::ordered_json spans = nlohmann::ordered_json::array();
  for (const parallel::RingSpan& s : run.spans) {
    spans.push_back({{"name", s.name},
                     {"lane", s.lane},
                     {"start_ms", s.start_s * 1e3},
                     {"duration_ms", s.duration_s * 1e3}});
  }
  out["spans"] = std::move(spans);
  return out;
}

absl::StatusOr<nlohmann::ordered_json> GatherRankSteps(const parallel::RingTimings& run,
                                                       const parallel::ProcessGrid& grid,
                                                       double flops_per_pair) {
  CPFILL_ASSIGN_OR_RETURN(std::string text, json::Dump(RankSteps(run, grid, flops_per_pair)));
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::string> all, parallel::AllGatherText(*grid.world, text));
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const std::string& t : all) out.push_back(nlohmann::ordered_json::parse(t));
  return out;
}

nlohmann::ordered_json ChromeTrace(const nlohmann::ordered_json& ranks) {
  double origin = std::numeric_limits<double>::infinity();
  for (const auto& r : ranks) origin = std::min(origin, r["start_unix_s"].get<double>());
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  for (const auto& r : ranks) {
    const int pid = r["world_rank"].get<int>();
    const double start_us = (r["start_unix_s"].get<double>() - origin) * 1e6;
    events.push_back(Metadata(
        "process_name", pid, 0,
        absl::StrFormat("rank %d (node %d, TP rank %d, CP rank %d)", pid, r["node"].get<int>(),
                        r["tp_rank"].get<int>(), r["cp_rank"].get<int>())));
    events.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"args", {{"sort_index", pid}}}});
    events.push_back(Metadata("thread_name", pid, LaneId("compute"), "compute"));
    events.push_back(Metadata("thread_name", pid, LaneId("exchange"), "exchange"));
    for (const auto& s : r["spans"]) {
      events.push_back({{"name", s["name"]},
                        {"cat", s["lane"]},
                        {"ph", "X"},
                        {"pid", pid},
                        {"tid", LaneId(s["lane"].get<std::string>())},
                        {"ts", start_us + s["start_ms"].get<double>() * 1e3},
                        {"dur", s["duration_ms"].get<double>() * 1e3}});
    }
  }
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

}  // namespace cpfill::launch
