// cpfill/launch/job/calibration.h — measuring a cluster for the selector: the compute rate C and
// ring bandwidth BW, pass-KV and pass-Q timed on a (T, P) grid (the paper's Table 4), and every
// selector rule's choice on that grid. `cpfill calibrate` orchestrates it; the fit itself is
// parallel::FitCoefficients.
//
//   CPFILL_ASSIGN_OR_RETURN(parallel::SystemSpec c, MeasureSystem(backend, world, shape, grid));
//   CPFILL_ASSIGN_OR_RETURN(auto points, TimeGrid(backend, process_grid, grid, on_point));
//   RuleEvaluation e = EvaluateRules(points, c, model, cp_size, fitted);
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "launch/job/attention_job.h"
#include "launch/job/backend.h"
#include "parallel/grid.h"
#include "parallel/selector.h"

namespace cpfill::launch {

struct CalibrationGrid {
  int heads = 8, kv_heads = 1, head_dim = 128;  // model totals (every TP rank together)
  std::vector<int64_t> context_lens;            // T + P
  std::vector<double> miss_rates;               // T / (T + P)
  int repeat = 3;                               // timed runs per point (median), after a warm-up
  int64_t compute_tokens = 2048;                // the causal square that measures C
  int64_t bandwidth_bytes = 64 << 20;           // the ring message that measures BW
  double elem_bytes = 2;                        // e, as the rules assume
};

// The most one rank holds at any moment of the calibration (the compute square of
// compute_tokens, the two ring messages of bandwidth_bytes, the largest grid point), counted
// before anything runs. InvalidArgument when a grid point does not split over the grid.
absl::StatusOr<BatchMemory> CalibrationMemory(const CalibrationGrid& f,
                                              const parallel::ProcessGrid& grid, bool device);

// Steps 1-2: C (TFLOP/s of one rank, all ranks at once, averaged) and BW (GB/s per rank, the
// slowest rank's), agreed over `world`.
absl::StatusOr<parallel::SystemSpec> MeasureSystem(Backend& backend, parallel::Communicator& world,
                                                   const attention::AttentionShape& shape,
                                                   const CalibrationGrid& f);

// Step 3: pass-KV and pass-Q at every (T, P) of the grid; `on_point` after each.
absl::StatusOr<std::vector<parallel::CalibrationPoint>> TimeGrid(
    Backend& backend, const parallel::ProcessGrid& grid, const CalibrationGrid& f,
    const std::function<void(const parallel::CalibrationPoint&)>& on_point);

// Every rule's choice at every point.
struct RuleEvaluation {
  std::vector<parallel::SelectorRule> rules = {parallel::SelectorRule::kAlg1,
                                               parallel::SelectorRule::kAlg5,
                                               parallel::SelectorRule::kFitted};
  std::vector<std::vector<bool>> picks_kv;  // [rule][point]
};
RuleEvaluation EvaluateRules(const std::vector<parallel::CalibrationPoint>& points,
                             const parallel::SystemSpec& system, const parallel::ModelSpec& model,
                             int cp_size, const parallel::FittedCoefficients& fitted);

// A rule's regret on some of the points: the total time of its choices over the total of the
// faster choice, minus 1; and how many of them it got wrong.
struct Regret {
  double regret = 0;
  int wrong = 0, count = 0;
};
Regret RegretOn(const std::vector<parallel::CalibrationPoint>& points,
                const std::vector<bool>& picks_kv, const std::vector<size_t>& which);

// The fitted rule judged on lengths its fit did not see: the distinct T in order, every other one
// held out (all its points), the fit made on the rest. `rules` holds every rule's choices at every
// point with that fit; compare them on `held_out` only. InvalidArgument when the rest is too few to
// fit.
struct HeldOutEvaluation {
  std::vector<size_t> held_out;  // indices into the points
  parallel::FittedCoefficients fitted;
  RuleEvaluation rules;
};
absl::StatusOr<HeldOutEvaluation> EvaluateHeldOut(
    const std::vector<parallel::CalibrationPoint>& points, const parallel::SystemSpec& system,
    const parallel::ModelSpec& model, int cp_size);

}  // namespace cpfill::launch
