// `cpfill attention`: one fused batch of context-parallel attention, timed like the paper's
// Table 5, optionally checked against a single-rank computation and saved for outside tools.
// The work lives in attention_job.h (batch, selection, timed runs, check) and ring_report.h.
#include <chrono>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/status.h"
#include "launch/attention_job.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/ring_report.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "launch/trace.h"

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
  SessionFlags session;
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
  flags.String("save", &f->save_file,
               "write q, k, v, o, lse in global token order to this safetensors file");
  flags.String("json", &f->json_file, "write the report as JSON to this file");
  flags.String("trace", &f->trace_file,
               "write the last run's timeline, every rank, as Chrome trace-event JSON (Perfetto)");
  flags.Int("repeat", &f->repeat, "runs of the batch (timings of each; the median is reported)")
      .Within({1, 1e6});
  flags.Int("seed", &f->seed, "seed of the synthetic inputs").Within(Range::AtLeast(0));
  flags.Bool("non-causal", &f->non_causal, "attend to every key (default: causal)");
  flags.String("backend", &f->backend,
               "auto | cpu | cuda: where partial attention runs (auto: cuda when a GPU is "
               "visible); cuda computes in bf16, so --check compares on bf16-rounded inputs");
  AddSessionFlags(flags, &f->session);
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

void PrintSetup(Session& session, const AttentionFlags& f, const AttentionBatch& b,
                const parallel::ProcessGrid& grid, const std::string& backend, int threads,
                const SelectorChoice& choice, const BatchSelection& sel,
                const std::vector<RingAlgorithm>& algos) {
  const AttentionSpec& s = f.spec;
  session.Print(
      "cpfill attention: %d sequence(s), new tokens %s, cached %s; %d query / %d KV heads x %d "
      "(per rank %d / %d), %s\n",
      b.plan.num_sequences(), absl::StrJoin(s.new_lens, "+"),
      s.cached_lens.empty() ? "0" : absl::StrJoin(s.cached_lens, "+"), s.heads, s.kv_heads,
      s.head_dim, b.model.num_heads, b.model.num_kv_heads, s.causal ? "causal" : "non-causal");
  session.Print("grid: %s; %s backend, %d kernel thread(s) per rank\n", grid.Describe(), backend,
                threads);
  session.Print("plan: 2N = %d chunks per sequence; padding %d new-token and %d KV slots\n",
                2 * grid.cp_size, b.plan.NewTokenPadding(), b.plan.KvPadding());
  const parallel::Selection& batch = sel.batch;
  session.Print("selector (%s%s), the batch as one: %s\n", parallel::SelectorRuleName(choice.rule),
                choice.rule == parallel::SelectorRule::kFitted ? ", " + batch.fitted.source : "",
                batch.reason);
  session.Print(
      "  predicted per layer: pass-kv %s ms, pass-q %s ms (C = %g TFLOP/s, BW = %g GB/s, e = "
      "%g)\n",
      Ms(batch.predicted.pass_kv_total_s), Ms(batch.predicted.pass_q_total_s), choice.system.tflops,
      choice.system.gbps, choice.system.elem_bytes);
  for (size_t i = 0; b.requests.size() > 1 && i < b.requests.size(); ++i) {
    session.Print("  sequence %d (T=%d, P=%d): %s\n", i, b.requests[i].new_tokens,
                  b.requests[i].cached_tokens, sel.per_sequence[i].reason);
  }
  const size_t rings = parallel::AlgorithmRuns(algos).size();
  session.Print(
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

nlohmann::ordered_json Report(const AttentionFlags& f, const AttentionBatch& b,
                              const parallel::ProcessGrid& grid, const Backend& backend,
                              int threads, const SelectorChoice& choice, const BatchSelection& sel,
                              const std::vector<RingAlgorithm>& algos, const TimedRuns& runs) {
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
      {"threads_per_rank", threads},
      {"backend", backend.name()},
      {"algorithm", parallel::AlgorithmsName(algos)},
      {"algorithm_source", choice.auto_algorithm ? "selector" : "--algo"},
      {"rings", parallel::AlgorithmRuns(algos).size()},
      {"selection", sel.batch.ToJson()},
      {"sequences", SequencesJson(b, sel, algos)},
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
AttentionCheck CheckOnRoot(Session& session, const AttentionBatch& b, const GlobalAttention& g,
                           double tolerance, parallel::Communicator& world) {
  AttentionCheck check;
  check.pass = session.VerdictFromRoot(world, [&] {
    session.Print("check: computing the single-rank reference (%d query tokens, all heads)...\n",
                  b.inputs.total_new_tokens());
    auto c = CheckAgainstOneRank(b, g, tolerance);
    if (!c.ok()) session.Fail(c.status());
    check = *c;
    session.Print(
        "check: max |O - O_ref| = %.3g, ||O - O_ref|| / ||O_ref|| = %.3g, max |LSE - LSE_ref| = "
        "%.3g, -inf mismatches %d (tolerance %g): %s\n",
        check.max_abs_o, check.rel_fro_o, check.max_abs_lse, check.lse_inf_mismatch, tolerance,
        check.pass ? "PASS" : "FAIL");
    return check.pass;
  });
  return check;
}

int Run(int argc, char** argv) {
  // Parse.
  AttentionFlags f;
  FlagSet flags("attention",
                "one fused batch of context-parallel attention over the CP ring (under mpirun)");
  DefineFlags(flags, &f);
  const absl::Status parsed = flags.Parse(argc, argv, 2);
  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session& session = *started.session;
  parallel::ProcessGrid& grid = *started.grid;
  if (auto bad = session.CheckOutputs(
          {{"save", f.save_file}, {"json", f.json_file}, {"trace", f.trace_file}})) {
    return *bad;
  }

  // Plan: every rank reaches the same verdict on the input.
  f.spec.causal = !f.non_causal;
  f.spec.seed = static_cast<uint64_t>(f.seed);
  if (f.repeat < 1 || !(f.tolerance > 0)) {
    return session.ConfigError(absl::InvalidArgumentError(absl::StrCat(
        "--repeat (", f.repeat, ") must be >= 1 and --tolerance (", f.tolerance, ") positive")));
  }
  const int threads = session.ThreadsPerRank(grid);
  auto backend = Backend::Create(f.backend, grid, session.mpi().options(), threads);
  if (!backend.ok()) return session.Refuse(backend.status());
  if ((*backend)->bf16() && !flags.IsSet("tolerance")) f.tolerance = 2e-2;  // bf16 inputs and P
  auto choice = ResolveSelector(f.selector, flags, RingContextOf((*backend)->name(), grid));
  if (!choice.ok()) return session.Refuse(choice.status());
  auto batch = MakeAttentionBatch(f.spec, grid);
  if (!batch.ok()) return session.ConfigError(batch.status());
  const bool gather = f.check || !f.save_file.empty();
  const BatchMemory need = AttentionMemory(*batch, grid, (*backend)->on_device(), gather, f.check);
  if (absl::Status s = CheckAttentionFits(
          need, **backend, *grid.world,
          "use more ranks (CP splits the tokens, --tp the heads) or fewer or shorter sequences");
      !s.ok()) {
    return session.Refuse(s);
  }
  auto sel = SelectForBatch(*batch, grid.cp_size, choice->system, choice->rule, choice->fitted);
  if (!sel.ok()) return session.ConfigError(sel.status());
  const std::vector<RingAlgorithm> algos =
      choice->auto_algorithm ? sel->Choices()
                             : Everywhere(choice->algorithm, batch->plan.num_sequences());
  PrintSetup(session, f, *batch, grid, (*backend)->Description(), threads, *choice, *sel, algos);

  // Run.
  auto runner = (*backend)->MakeRunner(batch->plan, batch->shape, batch->inputs, batch->slice);
  if (!runner.ok()) session.Fail(runner.status());
  InjectFaultForTests(grid.world_rank, "start");
  RunProgress progress;
  progress.on_step = [&](int run, const parallel::RingStepTiming& step, int steps) {
    if (step.step + 1 == steps) InjectFaultForTests(grid.world_rank, "merge");
    // A line per ring step once steps take long enough to wonder about.
    if (step.compute_s + step.wait_s <= 1.0) return;
    session.Print("  run %d, ring step %d/%d done: compute %s ms, exposed wait %s ms\n", run + 1,
                  step.step + 1, steps, Ms(step.compute_s), Ms(step.wait_s));
  };
  progress.on_run = [&](int run, double slowest_s) {
    session.Print("run %d/%d: %s ms on the slowest rank\n", run + 1, f.repeat, Ms(slowest_s));
  };
  auto runs = RunTimed(**runner, *grid.world, algos, f.repeat, 0, progress);
  if (!runs.ok()) session.Fail(runs.status());

  // Report: Table 5 for world rank 0's ring position, then the check, the file, the JSON.
  const parallel::RingTimings& last = runs->runs.back();
  const double gflop = last.visible_pairs * batch->flops_per_pair() / 1e9;
  session.Print("\n%s", RingStepTable(last, grid.cp_rank));
  session.Print(
      "  total %s ms on this rank; median over %d run(s) on the slowest rank %s ms; %.2f GFLOP "
      "on this rank, %.2f GFLOP/s\n",
      Ms(last.total_s), f.repeat, Ms(runs->median_s), gflop, gflop / last.total_s);
  GlobalAttention global;
  if (gather) {
    auto g = GatherGlobal(**runner, *batch, grid, (*backend)->bf16());
    if (!g.ok()) session.Fail(g.status());
    global = std::move(*g);
  }
  AttentionCheck check;
  if (f.check) check = CheckOnRoot(session, *batch, global, f.tolerance, *grid.world);
  if (session.is_root() && !f.save_file.empty()) {
    if (absl::Status s = SaveAttention(f.save_file, *batch, f.spec, global, algos); !s.ok()) {
      session.Fail(s);
    }
    session.Print("saved q, k, v, o, lse to %s\n", f.save_file);
  }
  nlohmann::ordered_json ranks;  // every rank's steps of the last run (collective)
  if (!f.json_file.empty() || !f.trace_file.empty()) {
    auto gathered = GatherRankSteps(last, grid, batch->flops_per_pair());
    if (!gathered.ok()) session.Fail(gathered.status());
    ranks = *std::move(gathered);
  }
  if (session.is_root() && !f.trace_file.empty()) {
    if (absl::Status s = json::WriteFile(f.trace_file, ChromeTrace(ranks)); !s.ok()) {
      session.Fail(absl::Status(s.code(), absl::StrCat("--trace: ", s.message())));
    }
    session.Print(
        "wrote the timeline of every rank's last run to %s (Perfetto, chrome://tracing)\n",
        f.trace_file);
  }
  if (session.is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json report =
        Report(f, *batch, grid, **backend, threads, *choice, *sel, algos, *runs);
    report["ranks"] = std::move(ranks);
    if (f.check) report["check"] = CheckJson(check, f.tolerance);
    session.WriteReport(f.json_file, std::move(report));
  }
  return f.check && !check.pass ? kExitCheckFailed : kExitOk;
}

}  // namespace

int RunAttentionCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
