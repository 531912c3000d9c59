// `cpfill prefill`: whole-model prefill of a Llama-3 family model (TP inside nodes, CP across),
// reporting the first token of every sequence and the time to first token with its breakdown;
// --check compares with a one-rank run of the same model. The work lives in model_setup.h
// (prompts, weights, backend, model) and prefill_check.h.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/job/backend.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/model_flags.h"
#include "launch/job/model_setup.h"
#include "launch/job/prefill_check.h"
#include "launch/job/selector_flags.h"
#include "launch/job/trace.h"
#include "parallel/mixed_ring.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/memory.h"
#include "runtime/model/model_config.h"
#include "runtime/model/safetensors.h"

namespace cpfill::launch {
namespace {

struct PrefillFlags {
  ModelFlags model;
  KvFlags kv;  // unsized: what the batch needs (KvTokensForBatch)
  std::vector<int64_t> prompt_lens;
  std::string tokens_file;
  SelectorFlags selector;
  bool check = false;
  double tolerance = 1e-3;
  std::string json_file;
  std::string logits_file;
  std::string trace_file;
  double peak_tflops = 0;
  int repeat = 1;
};

void DefineFlags(FlagSet& flags, PrefillFlags* f) {
  AddModelFlags(flags, &f->model);
  flags.IntList("prompt-lens", &f->prompt_lens, "synthetic prompts of these lengths (from --seed)")
      .Within({1, kMaxTokens});
  flags.String("tokens", &f->tokens_file,
               "a JSON list of lists of token ids (instead of --prompt-lens)");
  AddSelectorFlags(flags, &f->selector);
  flags.Bool("check", &f->check,
             "compare last-position logits and first tokens with a one-rank run (CPU, fp32)");
  flags
      .Double("tolerance", &f->tolerance,
              "max abs logit difference --check accepts (cuda: relative to the logits' scale, "
              "default 3e-2)")
      .Within(Range::Above(0));
  flags.String("json", &f->json_file, "write the report as JSON to this file").Output();
  flags
      .String("save-logits", &f->logits_file,
              "write the last-position logits [sequences, vocab] and first tokens as safetensors")
      .Output();
  flags
      .String("trace", &f->trace_file,
              "write the last run's timeline, every rank, as Chrome trace-event JSON (Perfetto): "
              "each layer's norms, GEMMs, RoPE, KV cache, attention ring and all-reduces")
      .Output();
  AddKvFlags(flags, &f->kv,
             {.unsized = "what this run's prompts need", .fraction_may_be_zero = true});
  flags
      .Double("peak-tflops", &f->peak_tflops,
              "peak dense TFLOP/s of one rank, for model FLOPs utilisation (0: not shown)")
      .Within(Range::AtLeast(0));
  flags
      .Int("repeat", &f->repeat,
           "timed prefills of the batch after one untimed warm-up when > 1 (median reported)")
      .Within({1, 1e6});
}

// What the plan settles before the first prefill, the same on every rank.
struct PrefillPlan {
  runtime::ModelConfig config;  // cut to --layers
  std::vector<runtime::PrefillRequest> batch;
  int64_t tokens = 0;  // in the batch
  runtime::StepOptions options;
  LoadedModel loaded;
  bool bf16 = false;  // the CUDA backend
};

// What the timed runs leave: the last run's outputs and timings, and the median TTFT.
struct PrefillRun {
  std::vector<runtime::SequenceOutput> out;
  runtime::StepTimings t;
  double ttft_s = 0;
};

// Every rank generates every synthetic prompt: their token ids must fit in every rank's memory
// before they are made (collective).
absl::Status PromptsFit(const PrefillFlags& f, parallel::Communicator& world) {
  double tokens = 0;
  for (int64_t n : f.prompt_lens) tokens += n;
  return runtime::CheckFitsOnEveryRank(
      world, absl::StrCat("the prompts' token ids (", tokens, " tokens, on every rank)"),
      runtime::SaturatingBytes(4 * tokens), [] { return runtime::HostBytesAvailable(); },
      "send fewer or shorter prompts (--prompt-lens)");
}

// The model's geometry (cut to --layers) and the prompts: bad input, the same on every rank.
absl::Status PlanInputs(const PrefillFlags& f, int tp_size, PrefillPlan* plan) {
  CPFILL_ASSIGN_OR_RETURN(plan->config, ModelConfigFor(f.model, tp_size));
  CPFILL_CHECK_ARG(f.prompt_lens.empty() != f.tokens_file.empty(),
                   "give exactly one of --prompt-lens and --tokens");
  if (!f.tokens_file.empty()) {
    CPFILL_ASSIGN_OR_RETURN(plan->batch, ReadTokensFile(f.tokens_file));
  } else {
    for (int64_t n : f.prompt_lens) {
      CPFILL_CHECK_ARG(n > 0, "--prompt-lens: every prompt needs at least one token, got ", n);
    }
    plan->batch = SyntheticPrompts(f.prompt_lens, plan->config.vocab_size,
                                   static_cast<uint64_t>(f.model.seed));
  }
  for (const auto& r : plan->batch) plan->tokens += r.tokens.size();
  return absl::OkStatus();
}

runtime::StepOptions OptionsFrom(const PrefillFlags& f, const SelectorChoice& choice,
                                 const std::vector<runtime::PrefillRequest>& batch, int cp_size,
                                 int threads) {
  runtime::StepOptions o = ModelOptions(choice);
  KvFlags kv = f.kv;
  if (!kv.sized()) kv.capacity_tokens = runtime::KvTokensForBatch(batch, cp_size, kv.block_tokens);
  kv.SetOptions(&o);
  o.threads = threads;
  o.record_spans = !f.trace_file.empty();
  return o;
}

// Plan: the backend (every rank must see a GPU for cuda), the geometry and prompts, the options,
// the weights and the model. Returns the exit code when the input is refused.
std::optional<int> Plan(PrefillFlags& f, const FlagSet& flags, Job& job,
                        const parallel::ProcessGrid& grid, PrefillPlan* plan) {
  auto backend = ResolveBackendName(f.model.backend, {"cpu", "cuda"}, *grid.world);
  if (!backend.ok()) return job.Refuse(backend.status());
  f.model.backend = *backend;
  plan->bf16 = f.model.backend == "cuda";
  if (plan->bf16 && !flags.IsSet("tolerance")) f.tolerance = 3e-2;  // relative, for bf16
  if (absl::Status s = PromptsFit(f, *grid.world); !s.ok()) return job.Refuse(s);
  if (absl::Status s = PlanInputs(f, grid.tp_size, plan); !s.ok()) return job.ConfigError(s);
  auto choice = ResolveSelector(f.selector, flags, RingContextOf(f.model.backend, grid));
  if (!choice.ok()) return job.Refuse(choice.status());
  plan->options = OptionsFrom(f, *choice, plan->batch, grid.cp_size, job.ThreadsPerRank(grid));
  auto weights =
      LoadWeightsAgreed(plan->config, f.model.name, static_cast<uint64_t>(f.model.seed), grid);
  if (!weights.ok()) return job.ConfigError(weights.status());
  auto loaded = BuildModel(plan->config, std::move(*weights), f.model.backend, grid,
                           job.mpi().options(), plan->options);
  if (!loaded.ok()) return job.Refuse(loaded.status());
  plan->loaded = std::move(*loaded);
  return std::nullopt;
}

void PrintPlan(Job& job, const parallel::ProcessGrid& grid, const PrefillPlan& plan) {
  const runtime::ModelConfig& config = plan.config;
  job.Print(
      "cpfill prefill: %s (%d layers, hidden %d, %d/%d heads, %.3g B parameters), %d "
      "sequence(s), %d tokens\n",
      config.name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
      config.ParameterCount() / 1e9, plan.batch.size(), plan.tokens);
  job.Print("grid: %s; %s backend, %d thread(s) per rank; KV cache %d blocks of %d tokens\n",
            grid.Describe(),
            plan.bf16 ? "CUDA (bf16, cuBLASLt, device ring on NCCL)" : "CPU (fp32)",
            plan.options.threads, plan.loaded.model->kv_usage().blocks_total,
            plan.options.kv_block_tokens);
}

// Run: with --repeat > 1 a warm-up run goes first (library handles, lazily loaded kernels); the
// median of the timed runs' slowest-rank times is the TTFT. The batch holds no job, so the runs
// are identical.
absl::StatusOr<PrefillRun> PrefillRepeated(Job& job, runtime::LlamaModel& model,
                                           parallel::Communicator& world,
                                           const std::vector<runtime::PrefillRequest>& batch,
                                           int repeat) {
  const int layers = model.config().num_layers;
  auto progress = [&](int layer) {
    if (layers >= 8 && (layer + 1) % std::max(1, layers / 8) == 0) {
      job.Print("  layer %d/%d done\n", layer + 1, layers);
    }
  };
  PrefillRun run;
  std::vector<double> times;
  for (int r = (repeat > 1 ? -1 : 0); r < repeat; ++r) {
    CPFILL_ASSIGN_OR_RETURN(
        run.out, model.Prefill(batch, &run.t,
                               r == repeat - 1 ? std::function<void(int)>(progress) : nullptr));
    double slowest = run.t.total_s;
    CPFILL_RETURN_IF_ERROR(
        world.AllReduce(&slowest, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMax));
    if (r >= 0) times.push_back(slowest);
  }
  std::sort(times.begin(), times.end());
  run.ttft_s = times[times.size() / 2];
  return run;
}

std::string Ms1(double s) { return absl::StrFormat("%.1f", s * 1e3); }

// The selector's decisions, every sequence's first token, the times.
void PrintRun(Job& job, const PrefillFlags& f, const parallel::ProcessGrid& grid,
              const PrefillPlan& plan, const PrefillRun& run) {
  const runtime::StepTimings& t = run.t;
  job.Print("selector (%s), the batch as one: %s\n", parallel::SelectorRuleName(plan.options.rule),
            t.selection.reason);
  job.Print("algorithm: %s (%d ring(s) per layer)\n", parallel::AlgorithmsName(t.algorithms),
            t.rings);
  for (size_t s = 0; s < run.out.size(); ++s) {
    job.Print("sequence %d: %d tokens, first token %d; %s\n", s, plan.batch[s].tokens.size(),
              run.out[s].first_token, t.selections[s].reason);
  }
  const double ttft = run.ttft_s;
  job.Print(
      "TTFT %s ms (slowest rank, median of %d run(s)); world rank 0, last run: GEMMs %s, "
      "attention ring %s, all-reduce %s, KV cache %s, LM head %s, embedding %s, other %s ms\n",
      Ms1(ttft), f.repeat, Ms1(t.gemm_s), Ms1(t.attention_s), Ms1(t.allreduce_s), Ms1(t.kv_s),
      Ms1(t.lm_head_s), Ms1(t.embed_s), Ms1(t.other_s));
  const double per_rank = t.model_flops / ttft / grid.world_size;
  job.Print("%.0f tokens/s; %.3g model TFLOP, %.3g TFLOP/s per rank", plan.tokens / ttft,
            t.model_flops / 1e12, per_rank / 1e12);
  if (f.peak_tflops > 0) job.Print(", MFU %.1f%%", 100 * per_rank / (f.peak_tflops * 1e12));
  job.Print("\n");
}

// The check runs on world rank 0; every rank learns the verdict.
PrefillCheck CheckOnRoot(Job& job, const PrefillFlags& f, const PrefillPlan& plan,
                         const std::vector<runtime::SequenceOutput>& out,
                         parallel::Communicator& world) {
  PrefillCheck check;
  check.pass = job.VerdictFromRoot(world, [&] {
    job.Print("check: prefilling the same batch on one rank (CPU, fp32)...\n");
    auto weights =
        MakeWeights(plan.config, f.model.name, static_cast<uint64_t>(f.model.seed), 0, 1);
    if (!weights.ok()) job.Fail(weights.status());
    auto c = CheckPrefillOnOneRank(plan.config, std::move(*weights), plan.batch, out, plan.options,
                                   plan.bf16, f.tolerance);
    if (!c.ok()) job.Fail(c.status());
    check = *c;
    job.Print(
        "check: max |logits - logits_1rank| = %.3g, first-token mismatches %d (tolerance %g): "
        "%s\n",
        check.max_abs_diff, check.token_mismatches, f.tolerance, check.pass ? "PASS" : "FAIL");
    return check.pass;
  });
  return check;
}

absl::Status SaveLogits(const std::string& path, const std::vector<runtime::SequenceOutput>& out,
                        int vocab) {
  std::vector<float> logits;
  std::vector<int32_t> first;
  for (const auto& o : out) {
    logits.insert(logits.end(), o.logits.begin(), o.logits.end());
    first.push_back(o.first_token);
  }
  runtime::SafetensorsWriter w;
  const int64_t n = static_cast<int64_t>(out.size());
  CPFILL_RETURN_IF_ERROR(w.Add("logits", runtime::DType::kF32, {n, vocab}, logits.data()));
  CPFILL_RETURN_IF_ERROR(w.Add("first_tokens", runtime::DType::kI32, {n}, first.data()));
  return w.Write(path);
}

// The last run's phases on every rank as one Chrome trace (collective; rank 0 writes it).
void WriteTrace(Job& job, const std::string& path, const runtime::StepTimings& t,
                const parallel::ProcessGrid& grid) {
  parallel::RingTimings timeline;
  timeline.start_unix_s = t.spans_origin_unix_s;
  timeline.spans.assign(t.spans.begin(), t.spans.end());
  auto ranks = GatherRankSteps(timeline, grid, 0);
  if (!ranks.ok()) job.Fail(ranks.status());
  if (!job.is_root()) return;
  if (absl::Status s = json::WriteFile(path, ChromeTrace(*ranks)); !s.ok()) {
    job.Fail(absl::Status(s.code(), absl::StrCat("--trace: ", s.message())));
  }
  job.Print("wrote the timeline of every rank's last run to %s (Perfetto, chrome://tracing)\n",
            path);
}

nlohmann::ordered_json ReportJson(const PrefillFlags& f, const parallel::ProcessGrid& grid,
                                  const PrefillPlan& plan, const PrefillRun& run) {
  const runtime::StepTimings& t = run.t;
  nlohmann::ordered_json seqs = nlohmann::ordered_json::array();
  for (size_t s = 0; s < run.out.size(); ++s) {
    seqs.push_back({{"tokens", static_cast<int64_t>(plan.batch[s].tokens.size())},
                    {"first_token", run.out[s].first_token},
                    {"algorithm", parallel::RingAlgorithmName(t.algorithms[s])},
                    {"selector", t.selections[s].reason}});
  }
  const runtime::KvUsage kv = plan.loaded.model->kv_usage();
  return {{"command", "prefill"},
          {"model", plan.config.name},
          {"layers", plan.config.num_layers},
          {"world_size", grid.world_size},
          {"tp", grid.tp_size},
          {"cp", grid.cp_size},
          {"backend", f.model.backend},
          {"algorithm", parallel::AlgorithmsName(t.algorithms)},
          {"rings", t.rings},
          {"sequences", std::move(seqs)},
          {"ttft_ms", run.ttft_s * 1e3},
          {"gemm_ms", t.gemm_s * 1e3},
          {"attention_ms", t.attention_s * 1e3},
          {"allreduce_ms", t.allreduce_s * 1e3},
          {"kv_cache_ms", t.kv_s * 1e3},
          {"lm_head_ms", t.lm_head_s * 1e3},
          {"other_ms", (t.other_s + t.embed_s) * 1e3},
          {"host_plan_ms", t.host_plan_s * 1e3},
          {"host_enqueue_ms", t.host_enqueue_s * 1e3},
          {"tokens_per_s", plan.tokens / run.ttft_s},
          {"model_tflop", t.model_flops / 1e12},
          {"kv_cache",
           {{"blocks_total", kv.blocks_total},
            {"block_tokens", f.kv.block_tokens},
            {"bytes_total", kv.bytes_total}}}};
}

// Report: what ran and how long it took, then the check, the logits, the trace, the JSON.
int Report(Job& job, const PrefillFlags& f, const parallel::ProcessGrid& grid,
           const PrefillPlan& plan, const PrefillRun& run) {
  PrintRun(job, f, grid, plan, run);
  PrefillCheck check;
  if (f.check) check = CheckOnRoot(job, f, plan, run.out, *grid.world);
  if (job.is_root() && !f.logits_file.empty()) {
    if (absl::Status s = SaveLogits(f.logits_file, run.out, plan.config.vocab_size); !s.ok()) {
      job.Fail(s);
    }
    job.Print("saved logits to %s\n", f.logits_file);
  }
  if (!f.trace_file.empty()) WriteTrace(job, f.trace_file, run.t, grid);
  if (job.is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json report = ReportJson(f, grid, plan, run);
    if (f.check) {
      report["check"] = {{"max_abs_logit_diff", check.max_abs_diff},
                         {"first_token_mismatches", check.token_mismatches},
                         {"pass", check.pass}};
    }
    job.WriteReport(f.json_file, std::move(report));
  }
  return f.check && !check.pass ? kExitCheckFailed : kExitOk;
}

// The command once its job has started: plan -> run -> report.
int Prefill(PrefillFlags& f, const FlagSet& flags, Job& job, const parallel::ProcessGrid& grid) {
  PrefillPlan plan;
  if (auto refused = Plan(f, flags, job, grid, &plan)) return *refused;
  PrintPlan(job, grid, plan);
  auto run = PrefillRepeated(job, *plan.loaded.model, *grid.world, plan.batch, f.repeat);
  if (!run.ok()) return job.Refuse(run.status());
  return Report(job, f, grid, plan, *run);
}

}  // namespace

int RunPrefillCommand(int argc, char** argv) {
  PrefillFlags f;
  FlagSet flags("prefill",
                "prefill a Llama-3 family model with TP inside nodes and CP across them; prints "
                "the first token per sequence and the time to first token (under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
    return Prefill(f, flags, job, grid);
  });
}

}  // namespace cpfill::launch
