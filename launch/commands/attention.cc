// `cpfill attention`: one fused batch of context-parallel attention, timed like the paper's
// Table 5, optionally checked against a single-rank computation and saved for outside tools.
// The work lives in attention_job.h (batch, selection, timed runs, check) and ring_report.h.
#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/job/attention_job.h"
#include "launch/job/backend.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/ring_report.h"
#include "launch/job/selector_flags.h"
#include "launch/job/trace.h"

namespace cpfill::launch {
namespace {

using parallel::RingAlgorithm;

struct AttentionFlags {
  AttentionSpec spec;
  bool non_causal = false;
  int64_t seed = 1;
  SelectorFlags selector;
  bool check = false;
  double tolerance = 1e-4;
  std::string save_file;
  std::string json_file;
  std::string trace_file;
  int repeat = 1;
  std::string backend = "auto";
};

void DefineFlags(FlagSet& flags, AttentionFlags* f) {
  flags.IntList("seq-lens", &f->spec.new_lens, "new tokens per sequence, comma separated", true)
      .Within({0, kMaxTokens});
  flags
      .IntList("cached-lens", &f->spec.cached_lens,
               "tokens already in the KV cache per sequence (partial prefill); laid out as one "
               "earlier full prefill left them")
      .Within({0, kMaxTokens});
  flags.Int("heads", &f->spec.heads, "query heads of the model (all TP ranks together)")
      .Within({1, 65536});
  flags.Int("kv-heads", &f->spec.kv_heads, "key/value heads of the model").Within({1, 65536});
  flags.Int("head-dim", &f->spec.head_dim, "head dimension").Within({1, 1024});
  AddSelectorFlags(flags, &f->selector);
  flags.Bool("check", &f->check,
             "compare with a single-rank computation; exit 1 above --tolerance");
  flags.Double("tolerance", &f->tolerance, "max abs error of O and LSE that --check accepts")
      .Within(Range::Above(0));
  flags
      .String("save", &f->save_file,
              "write q, k, v, o, lse in global token order to this safetensors file")
      .Output();
  flags.String("json", &f->json_file, "write the report as JSON to this file").Output();
  flags
      .String("trace", &f->trace_file,
              "write the last run's timeline, every rank, as Chrome trace-event JSON (Perfetto)")
      .Output();
  flags.Int("repeat", &f->repeat, "runs of the batch (timings of each; the median is reported)")
      .Within({1, 1e6});
  flags.Int("seed", &f->seed, "seed of the synthetic inputs").Within(Range::AtLeast(0));
  flags.Bool("non-causal", &f->non_causal, "attend to every key (default: causal)");
  flags.String("backend", &f->backend,
               "auto | cpu | cuda: where partial attention runs (auto: cuda when a GPU is "
               "visible); cuda computes in bf16, so --check compares on bf16-rounded inputs");
}

// What the plan settles before the first run, the same on every rank.
struct AttentionPlan {
  int threads = 0;  // kernel threads per rank
  std::unique_ptr<Backend> backend;
  SelectorChoice choice;
  AttentionBatch batch;
  BatchSelection sel;
  std::vector<RingAlgorithm> algos;  // per sequence: the selector's or --algo's
  bool gather = false;               // the whole batch is gathered on rank 0 (--check, --save)
};

// Plan: the backend, the selector's inputs, the batch and its memory, the selector's decision;
// every rank reaches the same verdict on the input. Returns the exit code when it is refused.
std::optional<int> Plan(AttentionFlags& f, const FlagSet& flags, Job& job,
                        const parallel::ProcessGrid& grid, AttentionPlan* plan) {
  f.spec.causal = !f.non_causal;
  f.spec.seed = static_cast<uint64_t>(f.seed);
  if (f.repeat < 1 || !(f.tolerance > 0)) {
    return job.ConfigError(absl::InvalidArgumentError(absl::StrCat(
        "--repeat (", f.repeat, ") must be >= 1 and --tolerance (", f.tolerance, ") positive")));
  }
  plan->threads = job.ThreadsPerRank(grid);
  auto backend = Backend::Create(f.backend, grid, job.mpi().options(), plan->threads);
  if (!backend.ok()) return job.Refuse(backend.status());
  plan->backend = *std::move(backend);
  if (plan->backend->bf16() && !flags.IsSet("tolerance")) f.tolerance = 2e-2;  // bf16 inputs, P
  auto choice = ResolveSelector(f.selector, flags, RingContextOf(plan->backend->name(), grid));
  if (!choice.ok()) return job.Refuse(choice.status());
  plan->choice = *std::move(choice);
  auto batch = MakeAttentionBatch(f.spec, grid);
  if (!batch.ok()) return job.ConfigError(batch.status());
  plan->batch = *std::move(batch);
  plan->gather = f.check || !f.save_file.empty();
  const BatchMemory need =
      AttentionMemory(plan->batch, grid, plan->backend->on_device(), plan->gather, f.check);
  if (absl::Status s = CheckAttentionFits(
          need, *plan->backend, *grid.world,
          "use more ranks (CP splits the tokens, --tp the heads) or fewer or shorter sequences");
      !s.ok()) {
    return job.Refuse(s);
  }
  const SelectorChoice& c = plan->choice;
  auto sel = SelectForBatch(plan->batch, grid.cp_size, c.system, c.rule, c.fitted);
  if (!sel.ok()) return job.ConfigError(sel.status());
  plan->sel = *std::move(sel);
  plan->algos = c.auto_algorithm ? plan->sel.Choices()
                                 : Everywhere(c.algorithm, plan->batch.plan.num_sequences());
  return std::nullopt;
}

// Fault injection for the end-to-end tests of a killed and a stalled rank (tests/cli_test.sh):
// CPFILL_TEST_EXIT_RANK=r kills world rank r (SIGKILL), CPFILL_TEST_STALL_RANK=r makes it stop
// answering, at CPFILL_TEST_FAULT_AT: "start" (just before the ring) or "merge" (after the last
// ring step, where the others wait in pass-Q's all-to-all; CPU ring only, whose steps report as
// they end).
void InjectFaultForTests(int world_rank, std::string_view at) {
  if (knobs::Choice(knobs::kTestFaultAt) != at) return;
  if (knobs::Int(knobs::kTestExitRank) == world_rank) std::raise(SIGKILL);
  if (knobs::Int(knobs::kTestStallRank) == world_rank) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

void PrintSetup(Job& job, const AttentionFlags& f, const parallel::ProcessGrid& grid,
                const AttentionPlan& plan) {
  const AttentionSpec& s = f.spec;
  const AttentionBatch& b = plan.batch;
  const SelectorChoice& choice = plan.choice;
  const BatchSelection& sel = plan.sel;
  const std::vector<RingAlgorithm>& algos = plan.algos;
  job.Print(
      "cpfill attention: %d sequence(s), new tokens %s, cached %s; %d query / %d KV heads x %d "
      "(per rank %d / %d), %s\n",
      b.plan.num_sequences(), absl::StrJoin(s.new_lens, "+"),
      s.cached_lens.empty() ? "0" : absl::StrJoin(s.cached_lens, "+"), s.heads, s.kv_heads,
      s.head_dim, b.model.num_heads, b.model.num_kv_heads, s.causal ? "causal" : "non-causal");
  job.Print("grid: %s; %s backend, %d kernel thread(s) per rank\n", grid.Describe(),
            plan.backend->Description(), plan.threads);
  job.Print("plan: 2N = %d chunks per sequence; padding %d new-token and %d KV slots\n",
            2 * grid.cp_size, b.plan.NewTokenPadding(), b.plan.KvPadding());
  const parallel::Selection& batch = sel.batch;
  job.Print("selector (%s%s), the batch as one: %s\n", parallel::SelectorRuleName(choice.rule),
            choice.rule == parallel::SelectorRule::kFitted ? ", " + batch.fitted.source : "",
            batch.reason);
  job.Print(
      "  predicted per layer: pass-kv %s ms, pass-q %s ms (C = %g TFLOP/s, BW = %g GB/s, e = "
      "%g)\n",
      Ms(batch.predicted.pass_kv_total_s), Ms(batch.predicted.pass_q_total_s), choice.system.tflops,
      choice.system.gbps, choice.system.elem_bytes);
  for (size_t i = 0; b.requests.size() > 1 && i < b.requests.size(); ++i) {
    job.Print("  sequence %d (T=%d, P=%d): %s\n", i, b.requests[i].new_tokens,
              b.requests[i].cached_tokens, sel.per_sequence[i].reason);
  }
  const size_t rings = parallel::AlgorithmRuns(algos).size();
  job.Print(
      "algorithm: %s (%s)%s\n", parallel::AlgorithmsName(algos),
      choice.auto_algorithm ? "each sequence's own, chosen by the selector" : "forced by --algo",
      rings > 1 ? absl::StrCat("; ", rings,
                               " rings, one per run of adjacent sequences "
                               "with one algorithm")
                : "");
}

// Each sequence's lengths, the selector's decision for it alone, and what ran.
nlohmann::ordered_json SequencesJson(const AttentionBatch& b, const BatchSelection& sel,
                                     const std::vector<RingAlgorithm>& algos) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < b.requests.size(); ++i) {
    out.push_back({{"new_tokens", b.requests[i].new_tokens},
                   {"cached_tokens", b.requests[i].cached_tokens},
                   {"algorithm", parallel::RingAlgorithmName(algos[i])},
                   {"selection", sel.per_sequence[i].ToJson()}});
  }
  return out;
}

nlohmann::ordered_json ReportJson(const AttentionFlags& f, const parallel::ProcessGrid& grid,
                                  const AttentionPlan& plan, const TimedRuns& runs) {
  const AttentionBatch& b = plan.batch;
  const SelectorChoice& choice = plan.choice;
  const std::vector<RingAlgorithm>& algos = plan.algos;
  std::vector<int64_t> cached_lens;
  for (const auto& r : b.requests) cached_lens.push_back(r.cached_tokens);
  nlohmann::ordered_json report = {
      {"command", "attention"},
      {"seq_lens", f.spec.new_lens},
      {"cached_lens", cached_lens},
      {"heads", f.spec.heads},
      {"kv_heads", f.spec.kv_heads},
      {"head_dim", f.spec.head_dim},
      {"causal", f.spec.causal},
      {"world_size", grid.world_size},
      {"tp", grid.tp_size},
      {"cp", grid.cp_size},
      {"nodes", grid.num_nodes},
      {"threads_per_rank", plan.threads},
      {"backend", plan.backend->name()},
      {"algorithm", parallel::AlgorithmsName(algos)},
      {"algorithm_source", choice.auto_algorithm ? "selector" : "--algo"},
      {"rings", parallel::AlgorithmRuns(algos).size()},
      {"selection", plan.sel.batch.ToJson()},
      {"sequences", SequencesJson(b, plan.sel, algos)},
      {"padding_new_slots", b.plan.NewTokenPadding()},
      {"padding_kv_slots", b.plan.KvPadding()}};
  nlohmann::ordered_json& rj = report["runs"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < runs.runs.size(); ++i) {
    rj.push_back(RingTimingsJson(runs.runs[i], b.flops_per_pair()));
    rj.back()["slowest_rank_total_ms"] = runs.slowest_s[i] * 1e3;
  }
  report["median_slowest_rank_total_ms"] = runs.median_s * 1e3;
  return report;
}

nlohmann::ordered_json CheckJson(const AttentionCheck& c, double tolerance) {
  return {{"max_abs_o", c.max_abs_o},     {"rel_fro_o", c.rel_fro_o},
          {"max_abs_lse", c.max_abs_lse}, {"lse_inf_mismatches", c.lse_inf_mismatch},
          {"tolerance", tolerance},       {"pass", c.pass}};
}

// The check runs on world rank 0; every rank learns the verdict.
AttentionCheck CheckOnRoot(Job& job, const AttentionBatch& b, const GlobalAttention& g,
                           double tolerance, parallel::Communicator& world) {
  AttentionCheck check;
  check.pass = job.VerdictFromRoot(world, [&] {
    job.Print("check: computing the single-rank reference (%d query tokens, all heads)...\n",
              b.inputs.total_new_tokens());
    auto c = CheckAgainstOneRank(b, g, tolerance);
    if (!c.ok()) job.Fail(c.status());
    check = *c;
    job.Print(
        "check: max |O - O_ref| = %.3g, ||O - O_ref|| / ||O_ref|| = %.3g, max |LSE - LSE_ref| = "
        "%.3g, -inf mismatches %d (tolerance %g): %s\n",
        check.max_abs_o, check.rel_fro_o, check.max_abs_lse, check.lse_inf_mismatch, tolerance,
        check.pass ? "PASS" : "FAIL");
    return check.pass;
  });
  return check;
}

// Run: the timed runs, a line per run (and per ring step once steps take long), with the tests'
// fault injection. A failure ends the job.
TimedRuns RunBatch(Job& job, const AttentionFlags& f, const parallel::ProcessGrid& grid,
                   const AttentionPlan& plan, Runner& runner) {
  InjectFaultForTests(grid.world_rank, "start");
  RunProgress progress;
  progress.on_step = [&](int run, const parallel::RingStepTiming& step, int steps) {
    if (step.step + 1 == steps) InjectFaultForTests(grid.world_rank, "merge");
    // A line per ring step once steps take long enough to wonder about.
    if (step.compute_s + step.wait_s <= 1.0) return;
    job.Print("  run %d, ring step %d/%d done: compute %s ms, exposed wait %s ms\n", run + 1,
              step.step + 1, steps, Ms(step.compute_s), Ms(step.wait_s));
  };
  progress.on_run = [&](int run, double slowest_s) {
    job.Print("run %d/%d: %s ms on the slowest rank\n", run + 1, f.repeat, Ms(slowest_s));
  };
  auto runs = RunTimed(runner, *grid.world, plan.algos, f.repeat, 0, progress);
  if (!runs.ok()) job.Fail(runs.status());
  return *std::move(runs);
}

// --save and --trace (collective: every rank's steps of the last run are gathered for --trace
// and --json); returns those steps.
nlohmann::ordered_json WriteFiles(Job& job, const AttentionFlags& f,
                                  const parallel::ProcessGrid& grid, const AttentionPlan& plan,
                                  const GlobalAttention& global,
                                  const parallel::RingTimings& last) {
  if (job.is_root() && !f.save_file.empty()) {
    if (absl::Status s = SaveAttention(f.save_file, plan.batch, f.spec, global, plan.algos);
        !s.ok()) {
      job.Fail(s);
    }
    job.Print("saved q, k, v, o, lse to %s\n", f.save_file);
  }
  nlohmann::ordered_json ranks;
  if (!f.json_file.empty() || !f.trace_file.empty()) {
    auto gathered = GatherRankSteps(last, grid, plan.batch.flops_per_pair());
    if (!gathered.ok()) job.Fail(gathered.status());
    ranks = *std::move(gathered);
  }
  if (job.is_root() && !f.trace_file.empty()) {
    if (absl::Status s = json::WriteFile(f.trace_file, ChromeTrace(ranks)); !s.ok()) {
      job.Fail(absl::Status(s.code(), absl::StrCat("--trace: ", s.message())));
    }
    job.Print("wrote the timeline of every rank's last run to %s (Perfetto, chrome://tracing)\n",
              f.trace_file);
  }
  return ranks;
}

// Report: Table 5 for world rank 0's ring position, then the check, the files, the JSON.
int Report(Job& job, const AttentionFlags& f, const parallel::ProcessGrid& grid,
           const AttentionPlan& plan, Runner& runner, const TimedRuns& runs) {
  const parallel::RingTimings& last = runs.runs.back();
  const double gflop = last.visible_pairs * plan.batch.flops_per_pair() / 1e9;
  job.Print("\n%s", RingStepTable(last, grid.cp_rank));
  job.Print(
      "  total %s ms on this rank; median over %d run(s) on the slowest rank %s ms; %.2f GFLOP "
      "on this rank, %.2f GFLOP/s\n",
      Ms(last.total_s), f.repeat, Ms(runs.median_s), gflop, gflop / last.total_s);
  GlobalAttention global;
  if (plan.gather) {
    auto g = GatherGlobal(runner, plan.batch, grid, plan.backend->bf16());
    if (!g.ok()) job.Fail(g.status());
    global = std::move(*g);
  }
  AttentionCheck check;
  if (f.check) check = CheckOnRoot(job, plan.batch, global, f.tolerance, *grid.world);
  nlohmann::ordered_json ranks = WriteFiles(job, f, grid, plan, global, last);
  if (job.is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json report = ReportJson(f, grid, plan, runs);
    report["ranks"] = std::move(ranks);
    if (f.check) report["check"] = CheckJson(check, f.tolerance);
    job.WriteReport(f.json_file, std::move(report));
  }
  return f.check && !check.pass ? kExitCheckFailed : kExitOk;
}

// The command once its job has started: plan -> run -> report.
int Attention(AttentionFlags& f, const FlagSet& flags, Job& job,
              const parallel::ProcessGrid& grid) {
  AttentionPlan plan;
  if (auto refused = Plan(f, flags, job, grid, &plan)) return *refused;
  PrintSetup(job, f, grid, plan);
  const AttentionBatch& b = plan.batch;
  auto runner = plan.backend->MakeRunner(b.plan, b.shape, b.inputs, b.slice);
  if (!runner.ok()) job.Fail(runner.status());
  const TimedRuns runs = RunBatch(job, f, grid, plan, **runner);
  return Report(job, f, grid, plan, **runner, runs);
}

}  // namespace

int RunAttentionCommand(int argc, char** argv) {
  AttentionFlags f;
  FlagSet flags("attention",
                "one fused batch of context-parallel attention over the CP ring (under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
    return Attention(f, flags, job, grid);
  });
}

}  // namespace cpfill::launch
