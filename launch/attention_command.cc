// `cpfill attention`: one fused batch of context-parallel attention, timed like the paper's
// Table 5, optionally checked against a single-rank computation and saved for outside tools.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "attention/attention.h"
#include "base/bfloat16.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "parallel/gather_outputs.h"
#include "parallel/ring_attention.h"
#include "parallel/selector.h"
#include "runtime/safetensors.h"
#include "runtime/synthetic_attention.h"
#include "sharding/plan.h"

namespace cpfill::launch {
namespace {

using parallel::RingAlgorithm;

struct AttentionFlags {
  std::vector<int64_t> seq_lens;
  std::vector<int64_t> cached_lens;
  int heads = 16;
  int kv_heads = 1;
  int head_dim = 128;
  SelectorFlags selector;
  bool check = false;
  double tolerance = 1e-4;
  std::string save_file;
  std::string json_file;
  int repeat = 1;
  int64_t seed = 1;
  bool non_causal = false;
  std::string backend = "auto";
  SessionFlags session;
};

// What the check found (world rank 0 computes it; every rank learns the verdict).
struct CheckResult {
  double max_abs_o = 0, rel_fro_o = 0, max_abs_lse = 0;
  int64_t lse_inf_mismatch = 0;
  bool pass = false;
};

absl::Status ValidateFlags(const AttentionFlags& f, const parallel::ProcessGrid& grid) {
  CPFILL_CHECK_ARG(!f.seq_lens.empty(), "--seq-lens needs at least one sequence");
  for (size_t i = 0; i < f.seq_lens.size(); ++i) {
    CPFILL_CHECK_ARG(f.seq_lens[i] >= 0, "--seq-lens: sequence ", i, " has negative length ",
                     f.seq_lens[i]);
  }
  CPFILL_CHECK_ARG(f.cached_lens.empty() || f.cached_lens.size() == f.seq_lens.size(),
                   "--cached-lens has ", f.cached_lens.size(), " entries but --seq-lens has ",
                   f.seq_lens.size(), "; give one cached length per sequence");
  for (size_t i = 0; i < f.cached_lens.size(); ++i) {
    CPFILL_CHECK_ARG(f.cached_lens[i] >= 0, "--cached-lens: sequence ", i, " has negative length ",
                     f.cached_lens[i]);
  }
  CPFILL_CHECK_ARG(f.heads > 0 && f.kv_heads > 0 && f.head_dim > 0, "--heads (", f.heads,
                   "), --kv-heads (", f.kv_heads, ") and --head-dim (", f.head_dim,
                   ") must be positive");
  CPFILL_CHECK_ARG(f.heads % f.kv_heads == 0, "--heads ", f.heads,
                   " is not a multiple of --kv-heads ", f.kv_heads, " (GQA groups must be whole)");
  CPFILL_CHECK_ARG(f.heads % grid.tp_size == 0 && f.kv_heads % grid.tp_size == 0, "--heads ",
                   f.heads, " and --kv-heads ", f.kv_heads, " must both divide by --tp ",
                   grid.tp_size);
  CPFILL_CHECK_ARG(f.repeat >= 1, "--repeat must be >= 1, got ", f.repeat);
  CPFILL_CHECK_ARG(f.tolerance > 0, "--tolerance must be positive");
  return absl::OkStatus();
}

CheckResult Compare(const std::vector<float>& o, const std::vector<float>& lse,
                    const std::vector<float>& o_ref, const std::vector<float>& lse_ref,
                    double tolerance) {
  CheckResult r;
  double diff2 = 0, ref2 = 0;
  bool finite = true;
  for (size_t i = 0; i < o.size(); ++i) {
    const double e = std::fabs(static_cast<double>(o[i]) - o_ref[i]);
    if (!std::isfinite(o[i])) finite = false;
    r.max_abs_o = std::max(r.max_abs_o, e);
    diff2 += e * e;
    ref2 += static_cast<double>(o_ref[i]) * o_ref[i];
  }
  r.rel_fro_o = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool a_inf = std::isinf(lse[i]) && lse[i] < 0,
               b_inf = std::isinf(lse_ref[i]) && lse_ref[i] < 0;
    if (a_inf != b_inf || std::isnan(lse[i])) {
      ++r.lse_inf_mismatch;
    } else if (!a_inf) {
      r.max_abs_lse = std::max(r.max_abs_lse, std::fabs(static_cast<double>(lse[i]) - lse_ref[i]));
    }
  }
  r.pass =
      finite && r.lse_inf_mismatch == 0 && r.max_abs_o <= tolerance && r.max_abs_lse <= tolerance;
  return r;
}

// Fault injection for the end-to-end tests of a dead and a stalled rank (tests/cli_test.sh):
// CPFILL_TEST_EXIT_RANK=r makes world rank r exit abruptly, CPFILL_TEST_STALL_RANK=r makes it
// stop answering, both just before the ring starts.
void InjectFaultForTests(int world_rank) {
  if (knobs::Int(knobs::kTestExitRank) == world_rank) std::_Exit(9);
  if (knobs::Int(knobs::kTestStallRank) == world_rank) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

std::string Ms(double s) { return absl::StrFormat("%.2f", s * 1e3); }

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30));
  if (b >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / double(1 << 20));
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

nlohmann::ordered_json TimingsJson(const parallel::RingTimings& t, double flops_per_pair) {
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const auto& s : t.steps) {
    steps.push_back({{"step", s.step},
                     {"source_cp_rank", s.source_cp_rank},
                     {"exchange_bytes", s.exchange_bytes},
                     {"transfer_ms", s.transfer_s * 1e3},
                     {"compute_ms", s.compute_s * 1e3},
                     {"exposed_wait_ms", s.wait_s * 1e3},
                     {"visible_pairs", s.visible_pairs},
                     {"chunk_pairs", s.chunk_pairs},
                     {"chunk_pairs_hidden_skipped", s.chunk_pairs_hidden}});
  }
  return {{"algorithm", parallel::RingAlgorithmName(t.algorithm)},
          {"steps", std::move(steps)},
          {"pack_ms", t.pack_s * 1e3},
          {"all_gather_ms", t.all_gather_s * 1e3},
          {"all_to_all_ms", t.all_to_all_s * 1e3},
          {"all_to_all_bytes", t.all_to_all_bytes},
          {"merge_ms", t.merge_s * 1e3},
          {"total_ms", t.total_s * 1e3},
          {"gflop", t.visible_pairs * flops_per_pair / 1e9}};
}

int Run(int argc, char** argv) {
  AttentionFlags f;
  FlagSet flags("attention",
                "one fused batch of context-parallel attention over the CP ring (under mpirun)");
  flags.IntList("seq-lens", &f.seq_lens, "new tokens per sequence, comma separated", true);
  flags.IntList("cached-lens", &f.cached_lens,
                "tokens already in the KV cache per sequence (partial prefill); laid out as one "
                "earlier full prefill left them");
  flags.Int("heads", &f.heads, "query heads of the model (all TP ranks together)");
  flags.Int("kv-heads", &f.kv_heads, "key/value heads of the model");
  flags.Int("head-dim", &f.head_dim, "head dimension");
  AddSelectorFlags(flags, &f.selector);
  flags.Bool("check", &f.check, "compare with a single-rank computation; exit 1 above --tolerance");
  flags.Double("tolerance", &f.tolerance, "max abs error of O and LSE that --check accepts");
  flags.String("save", &f.save_file,
               "write q, k, v, o, lse in global token order to this safetensors file");
  flags.String("json", &f.json_file, "write the report as JSON to this file");
  flags.Int("repeat", &f.repeat, "runs of the batch (timings of each; the median is reported)");
  flags.Int("seed", &f.seed, "seed of the synthetic inputs");
  flags.Bool("non-causal", &f.non_causal, "attend to every key (default: causal)");
  flags.String("backend", &f.backend,
               "auto | cpu | cuda: where partial attention runs (auto: cuda when a GPU is "
               "visible); cuda computes in bf16, so --check compares on bf16-rounded inputs");
  AddSessionFlags(flags, &f.session);
  const absl::Status parsed = flags.Parse(argc, argv, 2);

  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session* session = started.session.get();
  parallel::ProcessGrid& grid = *started.grid;
  // ---- configuration: every rank reaches the same verdict ----------------------------------
  if (absl::Status s = ValidateFlags(f, grid); !s.ok()) return session->ConfigError(s);
  const int threads = session->ThreadsPerRank(grid);
  auto backend_or = Backend::Create(f.backend, grid, session->mpi().options(), threads);
  if (!backend_or.ok()) return session->Refuse(backend_or.status());
  Backend& backend = **backend_or;
  if (backend.bf16() && !flags.IsSet("tolerance")) f.tolerance = 2e-2;  // bf16 inputs and P
  auto choice_or = ResolveSelector(f.selector, flags);
  if (!choice_or.ok()) return session->Refuse(choice_or.status());
  const SelectorChoice& choice = *choice_or;
  const parallel::SystemSpec& system = choice.system;
  const parallel::FittedCoefficients& fitted = choice.fitted;
  const parallel::SelectorRule rule = choice.rule;

  std::vector<sharding::SequenceRequest> requests;
  for (size_t i = 0; i < f.seq_lens.size(); ++i) {
    requests.push_back({.new_tokens = f.seq_lens[i],
                        .cached_tokens = f.cached_lens.empty() ? 0 : f.cached_lens[i]});
  }
  auto plan_or = sharding::PlanPrefill(requests, grid.cp_size);
  if (!plan_or.ok()) return session->ConfigError(plan_or.status());
  const sharding::ShardPlan& plan = *plan_or;

  // Selector: the decision is logged for every batch, also when --algo forces a choice.
  const parallel::ModelSpec model{.num_heads = f.heads / grid.tp_size,
                                  .num_kv_heads = f.kv_heads / grid.tp_size,
                                  .head_dim = f.head_dim};
  int64_t total_new = 0, total_cached = 0;
  for (const auto& r : requests) total_new += r.new_tokens, total_cached += r.cached_tokens;
  auto selection_or = parallel::Select({.system = system,
                                        .model = model,
                                        .cp_size = grid.cp_size,
                                        .new_tokens = std::max<int64_t>(total_new, 1),
                                        .cached_tokens = total_cached},
                                       rule, fitted);
  if (!selection_or.ok()) return session->ConfigError(selection_or.status());
  const parallel::Selection& selection = *selection_or;
  const RingAlgorithm algo = choice.auto_algorithm ? selection.choice : choice.algorithm;

  // ---- report the set-up ----------------------------------------------------------------
  session->Print(
      "cpfill attention: %d sequence(s), new tokens %s, cached %s; %d query / %d KV heads x %d "
      "(per rank %d / %d), %s\n",
      plan.num_sequences(), absl::StrJoin(f.seq_lens, "+"),
      f.cached_lens.empty() ? "0" : absl::StrJoin(f.cached_lens, "+"), f.heads, f.kv_heads,
      f.head_dim, model.num_heads, model.num_kv_heads, f.non_causal ? "non-causal" : "causal");
  session->Print("grid: %s; %s backend, %d kernel thread(s) per rank\n", grid.Describe(),
                 backend.Description(), threads);
  session->Print("plan: 2N = %d chunks per sequence; padding %d new-token and %d KV slots\n",
                 2 * grid.cp_size, plan.NewTokenPadding(), plan.KvPadding());
  session->Print("selector (%s%s): %s\n", parallel::SelectorRuleName(rule),
                 rule == parallel::SelectorRule::kFitted ? ", " + selection.fitted.source : "",
                 selection.reason);
  session->Print(
      "  predicted per layer: pass-kv %s ms, pass-q %s ms (C = %g TFLOP/s, BW = %g "
      "GB/s, e = %g)\n",
      Ms(selection.predicted.pass_kv_total_s), Ms(selection.predicted.pass_q_total_s),
      system.tflops, system.gbps, system.elem_bytes);
  if (plan.num_sequences() > 1) {
    for (int s = 0; s < plan.num_sequences(); ++s) {
      auto one = parallel::Select({.system = system,
                                   .model = model,
                                   .cp_size = grid.cp_size,
                                   .new_tokens = std::max<int64_t>(requests[s].new_tokens, 1),
                                   .cached_tokens = requests[s].cached_tokens},
                                  rule, fitted);
      if (one.ok()) {
        session->Print("  sequence %d alone (T=%d, P=%d): %s\n", s, requests[s].new_tokens,
                       requests[s].cached_tokens, parallel::RingAlgorithmName(one->choice));
      }
    }
  }
  session->Print("algorithm: %s (%s)\n", parallel::RingAlgorithmName(algo),
                 choice.auto_algorithm ? "chosen by the selector" : "forced by --algo");

  // ---- run ------------------------------------------------------------------------------
  const runtime::SyntheticAttention batch{.sequences = requests,
                                          .num_heads = f.heads,
                                          .num_kv_heads = f.kv_heads,
                                          .head_dim = f.head_dim,
                                          .seed = static_cast<uint64_t>(f.seed)};
  const runtime::HeadSlice slice =
      runtime::HeadSlice::ForTpRank(f.heads, f.kv_heads, grid.tp_rank, grid.tp_size);
  const attention::AttentionShape shape{.num_heads = model.num_heads,
                                        .num_kv_heads = model.num_kv_heads,
                                        .head_dim = f.head_dim,
                                        .softmax_scale = 1.0f / std::sqrt(float(f.head_dim)),
                                        .causal = !f.non_causal};
  auto runner_or = backend.MakeRunner(plan, shape, batch, slice);
  if (!runner_or.ok()) session->Fail(runner_or.status());
  Runner& runner = **runner_or;
  std::vector<float> o, lse;
  const double flops_per_pair = 4.0 * shape.head_dim * shape.num_heads;

  InjectFaultForTests(grid.world_rank);
  std::vector<parallel::RingTimings> runs;
  std::vector<double> slowest;
  for (int r = 0; r < f.repeat; ++r) {
    parallel::RingTimings t;
    // Progress: a line per ring step once steps take long enough for a user to wonder.
    auto progress = [&](const parallel::RingStepTiming& step, int steps) {
      if (step.compute_s + step.wait_s > 1.0) {
        session->Print("  run %d, ring step %d/%d done: compute %s ms, exposed wait %s ms\n", r + 1,
                       step.step + 1, steps, Ms(step.compute_s), Ms(step.wait_s));
      }
    };
    if (absl::Status s = runner.Run(algo, &t, progress); !s.ok()) session->Fail(s);
    double worst = t.total_s;
    if (absl::Status s = grid.world->AllReduce(&worst, 1, parallel::DataType::kFloat64,
                                               parallel::ReduceOp::kMax);
        !s.ok()) {
      session->Fail(s);
    }
    runs.push_back(t);
    slowest.push_back(worst);
    session->Print("run %d/%d: %s ms on the slowest rank\n", r + 1, f.repeat, Ms(worst));
  }
  if (absl::Status s = runner.Fetch(&o, &lse); !s.ok()) session->Fail(s);
  std::vector<double> sorted = slowest;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const parallel::RingTimings& last = runs.back();

  // Table 5 of the paper, for world rank 0's ring position.
  session->Print("\nring steps (world rank 0 = cp_rank %d, last run):\n", grid.cp_rank);
  session->Print("  %4s %6s %12s %12s %12s %14s %14s\n", "step", "source", "exchange",
                 "transfer ms", "compute ms", "exposed wait", "hidden pairs");
  for (const auto& s : last.steps) {
    session->Print("  %4d %6d %12s %12s %12s %14s %14s\n", s.step, s.source_cp_rank,
                   s.exchange_bytes ? Bytes(s.exchange_bytes) : "-", Ms(s.transfer_s),
                   Ms(s.compute_s), Ms(s.wait_s),
                   absl::StrCat(s.chunk_pairs_hidden, "/", s.chunk_pairs, " skipped"));
  }
  session->Print("  pack/unpack %s ms", Ms(last.pack_s));
  if (algo == RingAlgorithm::kAllGather)
    session->Print(", all-gather %s ms", Ms(last.all_gather_s));
  if (algo == RingAlgorithm::kPassQ) {
    session->Print(", all-to-all %s ms (%s), merge %s ms", Ms(last.all_to_all_s),
                   Bytes(last.all_to_all_bytes), Ms(last.merge_s));
  }
  const double gflop = last.visible_pairs * flops_per_pair / 1e9;
  session->Print(
      "\n  total %s ms on this rank; median over %d run(s) on the slowest rank %s ms; "
      "%.2f GFLOP on this rank, %.2f GFLOP/s\n",
      Ms(last.total_s), f.repeat, Ms(median), gflop, gflop / last.total_s);

  // ---- check and save -------------------------------------------------------------------
  CheckResult check;
  std::vector<float> o_all, lse_all;
  if (f.check || !f.save_file.empty()) {
    if (absl::Status s = parallel::GatherAttentionOutputs(
            *grid.world, plan, grid.tp_rank, grid.tp_size, grid.cp_rank, f.heads, f.head_dim,
            o.data(), lse.data(), &o_all, &lse_all);
        !s.ok()) {
      session->Fail(s);
    }
  }
  std::vector<float> q_all, k_all, v_all;
  if (session->is_root() && (f.check || !f.save_file.empty())) {
    q_all.resize(batch.total_new_tokens() * f.heads * f.head_dim);
    k_all.resize(batch.total_kv_tokens() * f.kv_heads * f.head_dim);
    v_all.resize(k_all.size());
    batch.FillGlobal(q_all.data(), k_all.data(), v_all.data());
    if (backend.bf16()) {  // the numbers the GPU saw
      RoundToBfloat16(q_all);
      RoundToBfloat16(k_all);
      RoundToBfloat16(v_all);
    }
  }
  if (f.check) {
    int32_t verdict = 1;
    if (session->is_root()) {
      session->Print("check: computing the single-rank reference (%d query tokens, all heads)...\n",
                     batch.total_new_tokens());
      ThreadPool ref_pool(0);
      parallel::CpuAttentionKernels ref_kernels(&ref_pool);
      attention::AttentionShape full = shape;
      full.num_heads = f.heads;
      full.num_kv_heads = f.kv_heads;
      std::vector<float> o_ref(o_all.size(), std::nanf("")), lse_ref(lse_all.size(), std::nanf(""));
      if (absl::Status s = parallel::SingleRankAttention(requests, full, q_all.data(), k_all.data(),
                                                         v_all.data(), o_ref.data(), lse_ref.data(),
                                                         &ref_kernels);
          !s.ok()) {
        session->Fail(s);
      }
      check = Compare(o_all, lse_all, o_ref, lse_ref, f.tolerance);
      verdict = check.pass ? 1 : 0;
      session->Print(
          "check: max |O - O_ref| = %.3g, ||O - O_ref|| / ||O_ref|| = %.3g, "
          "max |LSE - LSE_ref| = %.3g, -inf mismatches %d (tolerance %g): %s\n",
          check.max_abs_o, check.rel_fro_o, check.max_abs_lse, check.lse_inf_mismatch, f.tolerance,
          check.pass ? "PASS" : "FAIL");
    }
    if (absl::Status s = grid.world->Broadcast(&verdict, sizeof(verdict), 0); !s.ok()) {
      session->Fail(s);
    }
    check.pass = verdict == 1;
  }
  if (session->is_root() && !f.save_file.empty()) {
    runtime::SafetensorsWriter writer;
    const int64_t tn = batch.total_new_tokens(), tk = batch.total_kv_tokens();
    absl::Status s = writer.Add("q", runtime::DType::kF32, {tn, f.heads, f.head_dim}, q_all.data());
    if (s.ok())
      s = writer.Add("k", runtime::DType::kF32, {tk, f.kv_heads, f.head_dim}, k_all.data());
    if (s.ok())
      s = writer.Add("v", runtime::DType::kF32, {tk, f.kv_heads, f.head_dim}, v_all.data());
    if (s.ok()) s = writer.Add("o", runtime::DType::kF32, {tn, f.heads, f.head_dim}, o_all.data());
    if (s.ok()) s = writer.Add("lse", runtime::DType::kF32, {tn, f.heads}, lse_all.data());
    writer.SetMetadata("seq_lens", absl::StrJoin(f.seq_lens, ","));
    writer.SetMetadata("cached_lens",
                       f.cached_lens.empty() ? "" : absl::StrJoin(f.cached_lens, ","));
    writer.SetMetadata("algorithm", std::string(parallel::RingAlgorithmName(algo)));
    writer.SetMetadata("causal", f.non_causal ? "false" : "true");
    writer.SetMetadata("softmax_scale", absl::StrCat(shape.softmax_scale));
    writer.SetMetadata("layout",
                       "global token order; per sequence k/v hold cached then new "
                       "tokens, q/o/lse the new ones; lse natural log, -inf = no key");
    if (s.ok()) s = writer.Write(f.save_file);
    if (!s.ok()) session->Fail(s);
    session->Print("saved q, k, v, o, lse to %s\n", f.save_file);
  }
  if (session->is_root() && !f.json_file.empty()) {
    std::vector<int64_t> cached_lens;
    for (const auto& r : requests) cached_lens.push_back(r.cached_tokens);
    nlohmann::ordered_json report = {
        {"command", "attention"},
        {"seq_lens", f.seq_lens},
        {"cached_lens", cached_lens},
        {"heads", f.heads},
        {"kv_heads", f.kv_heads},
        {"head_dim", f.head_dim},
        {"causal", !f.non_causal},
        {"world_size", grid.world_size},
        {"tp", grid.tp_size},
        {"cp", grid.cp_size},
        {"nodes", grid.num_nodes},
        {"threads_per_rank", threads},
        {"backend", backend.name()},
        {"algorithm", parallel::RingAlgorithmName(algo)},
        {"algorithm_source", choice.auto_algorithm ? "selector" : "--algo"},
        {"selection", selection.ToJson()},
        {"padding_new_slots", plan.NewTokenPadding()},
        {"padding_kv_slots", plan.KvPadding()}};
    nlohmann::ordered_json rj = nlohmann::ordered_json::array();
    for (size_t i = 0; i < runs.size(); ++i) {
      rj.push_back(TimingsJson(runs[i], flops_per_pair));
      rj.back()["slowest_rank_total_ms"] = slowest[i] * 1e3;
    }
    report["runs"] = std::move(rj);
    report["median_slowest_rank_total_ms"] = median * 1e3;
    if (f.check) {
      nlohmann::ordered_json& c = report["check"];
      c["max_abs_o"] = check.max_abs_o;
      c["rel_fro_o"] = check.rel_fro_o;
      c["max_abs_lse"] = check.max_abs_lse;
      c["lse_inf_mismatches"] = check.lse_inf_mismatch;
      c["tolerance"] = f.tolerance;
      c["pass"] = check.pass;
    }
    session->WriteReport(f.json_file, std::move(report));
  }
  if (f.check && !check.pass) return kExitCheckFailed;
  return kExitOk;
}

}  // namespace

int RunAttentionCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
