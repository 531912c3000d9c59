#include "launch/calibration.h"

#include <algorithm>
#include <cmath>

#include "base/status.h"
#include "launch/attention_job.h"

namespace cpfill::launch {

using parallel::RingAlgorithm;

// Steps 1-2: C, the attention compute rate of one rank (all ranks at once, as in a real run,
// averaged), and BW, the ring bandwidth per rank (the slowest rank's).
absl::StatusOr<parallel::SystemSpec> MeasureSystem(Backend& backend, parallel::Communicator& world,
                                                   const attention::AttentionShape& shape,
                                                   const CalibrationGrid& f) {
  CPFILL_ASSIGN_OR_RETURN(double tflops, backend.MeasureTflops(shape, f.compute_tokens, f.repeat));
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&tflops, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kSum));
  CPFILL_ASSIGN_OR_RETURN(double gbps, backend.MeasureRingGbps(f.bandwidth_bytes, f.repeat));
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&gbps, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMin));
  return parallel::SystemSpec{
      .tflops = tflops / world.size(), .gbps = gbps, .elem_bytes = f.elem_bytes};
}

// Step 3: pass-KV and pass-Q at every (T, P) of the grid, T + P = each context length.
absl::StatusOr<std::vector<parallel::CalibrationPoint>> TimeGrid(
    Backend& backend, const parallel::ProcessGrid& grid, const CalibrationGrid& f,
    const std::function<void(const parallel::CalibrationPoint&)>& on_point) {
  std::vector<parallel::CalibrationPoint> points;
  for (int64_t ctx : f.context_lens) {
    for (double miss : f.miss_rates) {
      const int64_t t_new = std::clamp<int64_t>(std::llround(miss * ctx), 1, ctx);
      CPFILL_ASSIGN_OR_RETURN(AttentionBatch b, MakeAttentionBatch({.new_lens = {t_new},
                                                                    .cached_lens = {ctx - t_new},
                                                                    .heads = f.heads,
                                                                    .kv_heads = f.kv_heads,
                                                                    .head_dim = f.head_dim},
                                                                   grid));
      CPFILL_ASSIGN_OR_RETURN(auto runner, backend.MakeRunner(b.plan, b.shape, b.inputs, b.slice));
      parallel::CalibrationPoint pt{.new_tokens = t_new, .cached_tokens = ctx - t_new};
      CPFILL_ASSIGN_OR_RETURN(
          TimedRuns kv, RunTimed(*runner, *grid.world, RingAlgorithm::kPassKV, f.repeat, 1, {}));
      CPFILL_ASSIGN_OR_RETURN(
          TimedRuns pq, RunTimed(*runner, *grid.world, RingAlgorithm::kPassQ, f.repeat, 1, {}));
      pt.pass_kv_s = kv.median_s;
      pt.pass_q_s = pq.median_s;
      points.push_back(pt);
      on_point(pt);
    }
  }
  return points;
}

RuleEvaluation EvaluateRules(const std::vector<parallel::CalibrationPoint>& points,
                             const parallel::SystemSpec& system, const parallel::ModelSpec& model,
                             int cp_size, const parallel::FittedCoefficients& fitted) {
  RuleEvaluation e;
  e.picks_kv.resize(e.rules.size());
  parallel::SystemSpec sys = system;
  sys.gbps = system.gbps > 0 ? system.gbps : 1e-9;
  for (size_t r = 0; r < e.rules.size(); ++r) {
    for (const auto& p : points) {
      auto sel = parallel::Select({.system = sys,
                                   .model = model,
                                   .cp_size = cp_size,
                                   .new_tokens = p.new_tokens,
                                   .cached_tokens = p.cached_tokens},
                                  e.rules[r], fitted);
      e.picks_kv[r].push_back(sel.ok() && sel->choice == RingAlgorithm::kPassKV);
    }
  }
  return e;
}

}  // namespace cpfill::launch
