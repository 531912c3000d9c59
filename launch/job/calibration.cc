#include "launch/job/calibration.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/status.h"
#include "launch/job/attention_job.h"
#include "runtime/model/memory.h"

namespace cpfill::launch {

using parallel::RingAlgorithm;

namespace {

// The grid point (T new after P cached) with T = miss * ctx, at least one token.
AttentionSpec GridPoint(const CalibrationGrid& f, int64_t ctx, double miss) {
  const int64_t t_new = std::clamp<int64_t>(std::llround(miss * ctx), 1, ctx);
  return {.new_lens = {t_new},
          .cached_lens = {ctx - t_new},
          .heads = f.heads,
          .kv_heads = f.kv_heads,
          .head_dim = f.head_dim};
}

}  // namespace

absl::StatusOr<BatchMemory> CalibrationMemory(const CalibrationGrid& f,
                                              const parallel::ProcessGrid& grid, bool device) {
  // The compute square: q, k, v, o, lse of compute_tokens (fp32 on the host; bf16 on a GPU).
  const double t = f.compute_tokens, hq = f.heads / grid.tp_size, hkv = f.kv_heads / grid.tp_size;
  const double square = t * f.head_dim * (2 * hq + 2 * hkv) + t * hq;
  BatchMemory most{.host = runtime::SaturatingBytes(4 * square + (device ? 2 * square : 0)),
                   .device = runtime::SaturatingBytes(device ? 2 * square : 0)};
  const int64_t message = runtime::SaturatingBytes(2.0 * f.bandwidth_bytes);  // send + receive
  (device ? most.device : most.host) = std::max(device ? most.device : most.host, message);
  for (int64_t ctx : f.context_lens) {
    for (double miss : f.miss_rates) {
      CPFILL_ASSIGN_OR_RETURN(AttentionBatch b, MakeAttentionBatch(GridPoint(f, ctx, miss), grid));
      const BatchMemory point = AttentionMemory(b, grid, device, false, false);
      most.host = std::max(most.host, point.host);
      most.device = std::max(most.device, point.device);
    }
  }
  return most;
}

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
      CPFILL_ASSIGN_OR_RETURN(AttentionBatch b, MakeAttentionBatch(GridPoint(f, ctx, miss), grid));
      CPFILL_ASSIGN_OR_RETURN(auto runner, backend.MakeRunner(b.plan, b.shape, b.inputs, b.slice));
      parallel::CalibrationPoint pt{.new_tokens = b.requests[0].new_tokens,
                                    .cached_tokens = b.requests[0].cached_tokens};
      const auto all_on = [&](RingAlgorithm a) { return Everywhere(a, b.plan.num_sequences()); };
      CPFILL_ASSIGN_OR_RETURN(
          TimedRuns kv,
          RunTimed(*runner, *grid.world, all_on(RingAlgorithm::kPassKV), f.repeat, 1, {}));
      CPFILL_ASSIGN_OR_RETURN(
          TimedRuns pq,
          RunTimed(*runner, *grid.world, all_on(RingAlgorithm::kPassQ), f.repeat, 1, {}));
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

Regret RegretOn(const std::vector<parallel::CalibrationPoint>& points,
                const std::vector<bool>& picks_kv, const std::vector<size_t>& which) {
  double best = 0, chosen = 0;
  Regret r;
  for (size_t i : which) {
    const parallel::CalibrationPoint& p = points[i];
    best += std::min(p.pass_kv_s, p.pass_q_s);
    chosen += picks_kv[i] ? p.pass_kv_s : p.pass_q_s;
    r.wrong += picks_kv[i] != (p.pass_kv_s <= p.pass_q_s);
    ++r.count;
  }
  r.regret = best > 0 ? chosen / best - 1 : 0;
  return r;
}

absl::StatusOr<HeldOutEvaluation> EvaluateHeldOut(
    const std::vector<parallel::CalibrationPoint>& points, const parallel::SystemSpec& system,
    const parallel::ModelSpec& model, int cp_size) {
  std::vector<size_t> order(points.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return points[x].new_tokens < points[y].new_tokens; });
  // Alternate whole lengths, not points: points of one T go to the same side.
  HeldOutEvaluation e;
  std::vector<parallel::CalibrationPoint> seen;
  int group = -1;
  for (size_t k = 0; k < order.size(); ++k) {
    if (k == 0 || points[order[k]].new_tokens != points[order[k - 1]].new_tokens) ++group;
    if (group % 2 == 1) {
      e.held_out.push_back(order[k]);
    } else {
      seen.push_back(points[order[k]]);
    }
  }
  CPFILL_ASSIGN_OR_RETURN(e.fitted, parallel::FitCoefficients(seen));
  e.rules = EvaluateRules(points, system, model, cp_size, e.fitted);
  return e;
}

}  // namespace cpfill::launch
