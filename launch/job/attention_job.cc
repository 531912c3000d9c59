#include "launch/job/attention_job.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bfloat16.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "parallel/gather_outputs.h"
#include "runtime/model/memory.h"
#include "runtime/model/safetensors.h"

namespace cpfill::launch {
namespace {

absl::Status ValidateSpec(const AttentionSpec& s, const parallel::ProcessGrid& grid) {
  CPFILL_CHECK_ARG(!s.new_lens.empty(), "--seq-lens needs at least one sequence");
  for (size_t i = 0; i < s.new_lens.size(); ++i) {
    CPFILL_CHECK_ARG(s.new_lens[i] >= 0, "--seq-lens: sequence ", i, " has negative length ",
                     s.new_lens[i]);
  }
  CPFILL_CHECK_ARG(s.cached_lens.empty() || s.cached_lens.size() == s.new_lens.size(),
                   "--cached-lens has ", s.cached_lens.size(), " entries but --seq-lens has ",
                   s.new_lens.size(), "; give one cached length per sequence");
  for (size_t i = 0; i < s.cached_lens.size(); ++i) {
    CPFILL_CHECK_ARG(s.cached_lens[i] >= 0, "--cached-lens: sequence ", i, " has negative length ",
                     s.cached_lens[i]);
  }
  CPFILL_CHECK_ARG(s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0, "--heads (", s.heads,
                   "), --kv-heads (", s.kv_heads, ") and --head-dim (", s.head_dim,
                   ") must be positive");
  CPFILL_CHECK_ARG(s.heads % s.kv_heads == 0, "--heads ", s.heads,
                   " is not a multiple of --kv-heads ", s.kv_heads, " (GQA groups must be whole)");
  CPFILL_CHECK_ARG(s.heads % grid.tp_size == 0 && s.kv_heads % grid.tp_size == 0, "--heads ",
                   s.heads, " and --kv-heads ", s.kv_heads, " must both divide by --tp ",
                   grid.tp_size);
  return absl::OkStatus();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

absl::StatusOr<AttentionBatch> MakeAttentionBatch(const AttentionSpec& spec,
                                                  const parallel::ProcessGrid& grid) {
  CPFILL_RETURN_IF_ERROR(ValidateSpec(spec, grid));
  AttentionBatch b;
  for (size_t i = 0; i < spec.new_lens.size(); ++i) {
    b.requests.push_back({.new_tokens = spec.new_lens[i],
                          .cached_tokens = spec.cached_lens.empty() ? 0 : spec.cached_lens[i]});
  }
  CPFILL_ASSIGN_OR_RETURN(b.plan, sharding::PlanPrefill(b.requests, grid.cp_size));
  b.model = {.num_heads = spec.heads / grid.tp_size,
             .num_kv_heads = spec.kv_heads / grid.tp_size,
             .head_dim = spec.head_dim};
  b.shape = {.num_heads = b.model.num_heads,
             .num_kv_heads = b.model.num_kv_heads,
             .head_dim = spec.head_dim,
             .softmax_scale = 1.0f / std::sqrt(float(spec.head_dim)),
             .causal = spec.causal};
  b.inputs = {.sequences = b.requests,
              .num_heads = spec.heads,
              .num_kv_heads = spec.kv_heads,
              .head_dim = spec.head_dim,
              .seed = spec.seed};
  b.slice = HeadSlice::ForTpRank(spec.heads, spec.kv_heads, grid.tp_rank, grid.tp_size);
  return b;
}

BatchMemory AttentionMemory(const AttentionBatch& b, const parallel::ProcessGrid& grid, bool device,
                            bool gather, bool check) {
  // Element counts in double: lengths up to 2^31 times heads times head_dim overflow int64
  // for a batch of many sequences; the count is only compared with what is free.
  double q_rows = 0, kv_rows = 0, padded_kv = 0;
  const double padded_new = static_cast<double>(b.plan.MaxRankNewTokens());
  for (int s = 0; s < b.plan.num_sequences(); ++s) {
    const sharding::RankSequenceShard& mine = b.plan.shard(grid.cp_rank, s);
    q_rows += mine.new_tokens();
    kv_rows += mine.kv_tokens();
    padded_kv += b.plan.PaddedKvTokens(s);
  }
  const double hq = b.shape.num_heads, hkv = b.shape.num_kv_heads, d = b.shape.head_dim;
  const double inputs = q_rows * hq * d + 2 * kv_rows * hkv * d;
  const double outputs = q_rows * hq * (d + 1);  // O and LSE
  // Pass-KV sends and receives padded KV; pass-Q the largest rank's Q rows (its messages, in
  // the element type), then keeps a partial O and LSE block per CP rank, sent and received
  // (always fp32). A ring of one rank allocates none of it.
  const double messages = 2 * (2 * padded_kv * hkv * d) + 2 * padded_new * hq * d;
  const double partials = grid.cp_size > 1 ? 2.0 * grid.cp_size * padded_new * hq * (d + 1) : 0.0;
  double host = 4 * (inputs + outputs);
  double dev = 0;
  if (device) {
    host += 2 * inputs;                                        // the bf16 copy uploaded
    dev = 2 * (inputs + messages) + 4 * (outputs + partials);  // bf16 shard and messages
  } else {
    host += 4 * (messages + partials);
  }
  if (gather && grid.world_rank == 0) {
    const SyntheticAttention& in = b.inputs;
    const double all_q = double(in.total_new_tokens()) * in.num_heads * in.head_dim;
    const double all_kv = 2.0 * in.total_kv_tokens() * in.num_kv_heads * in.head_dim;
    const double all_out = double(in.total_new_tokens()) * in.num_heads * (in.head_dim + 1);
    host += 4 * (all_q + all_kv + 2 * all_out + (check ? all_out : 0));  // + gathered blocks
  }
  return {runtime::SaturatingBytes(host), runtime::SaturatingBytes(dev)};
}

absl::Status CheckAttentionFits(const BatchMemory& need, Backend& backend,
                                parallel::Communicator& world, const std::string& remedy) {
  CPFILL_RETURN_IF_ERROR(runtime::CheckFitsOnEveryRank(
      world, "the batch's host buffers", need.host, [] { return runtime::HostBytesAvailable(); },
      remedy));
  return runtime::CheckFitsOnEveryRank(
      world, "the batch's GPU buffers", need.device, [&] { return backend.FreeDeviceBytes(); },
      remedy);
}

absl::StatusOr<BatchSelection> SelectForBatch(const AttentionBatch& b, int cp_size,
                                              const parallel::SystemSpec& system,
                                              parallel::SelectorRule rule,
                                              const parallel::FittedCoefficients& fitted) {
  const auto select = [&](int64_t new_tokens, int64_t cached_tokens) {
    return parallel::Select({.system = system,
                             .model = b.model,
                             .cp_size = cp_size,
                             .new_tokens = std::max<int64_t>(new_tokens, 1),
                             .cached_tokens = cached_tokens},
                            rule, fitted);
  };
  int64_t total_new = 0, total_cached = 0;
  for (const auto& r : b.requests) total_new += r.new_tokens, total_cached += r.cached_tokens;
  BatchSelection out;
  CPFILL_ASSIGN_OR_RETURN(out.batch, select(total_new, total_cached));
  for (const auto& r : b.requests) {
    CPFILL_ASSIGN_OR_RETURN(parallel::Selection one, select(r.new_tokens, r.cached_tokens));
    out.per_sequence.push_back(std::move(one));
  }
  return out;
}

std::vector<parallel::RingAlgorithm> BatchSelection::Choices() const {
  std::vector<parallel::RingAlgorithm> out;
  for (const parallel::Selection& s : per_sequence) out.push_back(s.choice);
  return out;
}

std::vector<parallel::RingAlgorithm> Everywhere(parallel::RingAlgorithm algo, int num_sequences) {
  return std::vector<parallel::RingAlgorithm>(num_sequences, algo);
}

absl::StatusOr<TimedRuns> RunTimed(Runner& runner, parallel::Communicator& world,
                                   const std::vector<parallel::RingAlgorithm>& per_sequence,
                                   int repeat, int warmup, const RunProgress& progress) {
  TimedRuns out;
  for (int r = -warmup; r < repeat; ++r) {
    CPFILL_RETURN_IF_ERROR(world.Barrier());
    parallel::RingTimings t;
    auto on_step = [&](const parallel::RingStepTiming& step, int steps) {
      if (progress.on_step && r >= 0) progress.on_step(r, step, steps);
    };
    CPFILL_RETURN_IF_ERROR(runner.Run(per_sequence, &t, on_step));
    double slowest = t.total_s;
    CPFILL_RETURN_IF_ERROR(
        world.AllReduce(&slowest, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMax));
    if (r < 0) continue;  // warm-up: sizes the buffers, loads the kernels
    out.runs.push_back(t);
    out.slowest_s.push_back(slowest);
    if (progress.on_run) progress.on_run(r, slowest);
  }
  out.median_s = Median(out.slowest_s);
  return out;
}

absl::StatusOr<GlobalAttention> GatherGlobal(Runner& runner, const AttentionBatch& b,
                                             const parallel::ProcessGrid& grid, bool bf16) {
  std::vector<float> o, lse;
  CPFILL_RETURN_IF_ERROR(runner.Fetch(&o, &lse));
  GlobalAttention g;
  const SyntheticAttention& in = b.inputs;
  CPFILL_RETURN_IF_ERROR(parallel::GatherAttentionOutputs(
      *grid.world, b.plan, grid.tp_rank, grid.tp_size, grid.cp_rank, in.num_heads, in.head_dim,
      o.data(), lse.data(), &g.o, &g.lse));
  if (grid.world_rank != 0) return g;
  g.q.resize(in.total_new_tokens() * in.num_heads * in.head_dim);
  g.k.resize(in.total_kv_tokens() * in.num_kv_heads * in.head_dim);
  g.v.resize(g.k.size());
  in.FillGlobal(g.q.data(), g.k.data(), g.v.data());
  if (bf16) {  // the numbers the GPU saw
    RoundToBfloat16(g.q);
    RoundToBfloat16(g.k);
    RoundToBfloat16(g.v);
  }
  return g;
}

absl::StatusOr<AttentionCheck> CheckAgainstOneRank(const AttentionBatch& b,
                                                   const GlobalAttention& g, double tolerance) {
  ThreadPool pool(0);
  parallel::CpuRingOps kernels(&pool);
  attention::AttentionShape full = b.shape;
  full.num_heads = b.inputs.num_heads;
  full.num_kv_heads = b.inputs.num_kv_heads;
  std::vector<float> o_ref(g.o.size(), std::nanf("")), lse_ref(g.lse.size(), std::nanf(""));
  CPFILL_RETURN_IF_ERROR(parallel::SingleRankAttention(b.requests, full, g.q.data(), g.k.data(),
                                                       g.v.data(), o_ref.data(), lse_ref.data(),
                                                       &kernels));
  AttentionCheck r;
  double diff2 = 0, ref2 = 0;
  bool finite = true;
  for (size_t i = 0; i < g.o.size(); ++i) {
    const double e = std::fabs(static_cast<double>(g.o[i]) - o_ref[i]);
    finite = finite && std::isfinite(g.o[i]);
    r.max_abs_o = std::max(r.max_abs_o, e);
    diff2 += e * e;
    ref2 += static_cast<double>(o_ref[i]) * o_ref[i];
  }
  r.rel_fro_o = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  // A row that sees no key has LSE = -inf: both sides must agree on which rows those are.
  for (size_t i = 0; i < g.lse.size(); ++i) {
    const bool a_inf = std::isinf(g.lse[i]) && g.lse[i] < 0;
    const bool b_inf = std::isinf(lse_ref[i]) && lse_ref[i] < 0;
    if (a_inf != b_inf || std::isnan(g.lse[i])) {
      ++r.lse_inf_mismatch;
    } else if (!a_inf) {
      r.max_abs_lse = std::max(r.max_abs_lse, std::fabs(double(g.lse[i]) - lse_ref[i]));
    }
  }
  r.pass =
      finite && r.lse_inf_mismatch == 0 && r.max_abs_o <= tolerance && r.max_abs_lse <= tolerance;
  return r;
}

absl::Status SaveAttention(const std::string& path, const AttentionBatch& b,
                           const AttentionSpec& spec, const GlobalAttention& g,
                           const std::vector<parallel::RingAlgorithm>& per_sequence) {
  const SyntheticAttention& in = b.inputs;
  const int64_t tn = in.total_new_tokens(), tk = in.total_kv_tokens();
  runtime::SafetensorsWriter w;
  using runtime::DType;
  CPFILL_RETURN_IF_ERROR(w.Add("q", DType::kF32, {tn, in.num_heads, in.head_dim}, g.q.data()));
  CPFILL_RETURN_IF_ERROR(w.Add("k", DType::kF32, {tk, in.num_kv_heads, in.head_dim}, g.k.data()));
  CPFILL_RETURN_IF_ERROR(w.Add("v", DType::kF32, {tk, in.num_kv_heads, in.head_dim}, g.v.data()));
  CPFILL_RETURN_IF_ERROR(w.Add("o", DType::kF32, {tn, in.num_heads, in.head_dim}, g.o.data()));
  CPFILL_RETURN_IF_ERROR(w.Add("lse", DType::kF32, {tn, in.num_heads}, g.lse.data()));
  w.SetMetadata("seq_lens", absl::StrJoin(spec.new_lens, ","));
  w.SetMetadata("cached_lens", absl::StrJoin(spec.cached_lens, ","));
  w.SetMetadata("algorithm", parallel::AlgorithmsName(per_sequence));
  w.SetMetadata("causal", spec.causal ? "true" : "false");
  w.SetMetadata("softmax_scale", absl::StrCat(b.shape.softmax_scale));
  w.SetMetadata("layout",
                "global token order; per sequence k/v hold cached then new tokens, q/o/lse the "
                "new ones; lse natural log, -inf = no key");
  return w.Write(path);
}

}  // namespace cpfill::launch
