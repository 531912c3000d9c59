// `cpfill prefill`: whole-model prefill of a Llama-3 family model (TP inside nodes, CP across),
// reporting the first token of every sequence and the time to first token with its breakdown;
// --check compares with a one-rank run of the same model. The work lives in model_setup.h
// (prompts, weights, backend, model) and prefill_check.h.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/model_setup.h"
#include "launch/prefill_check.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "launch/trace.h"
#include "parallel/mixed_ring.h"
#include "runtime/llama_model.h"
#include "runtime/memory.h"
#include "runtime/model_config.h"
#include "runtime/safetensors.h"

namespace cpfill::launch {
namespace {

struct PrefillFlags {
  std::string model;
  std::vector<int64_t> prompt_lens;
  std::string tokens_file;
  int layers = 0;
  SelectorFlags selector;
  bool check = false;
  double tolerance = 1e-3;
  std::string json_file;
  std::string logits_file;
  std::string trace_file;
  int64_t seed = 1;
  int64_t kv_capacity_tokens = 0;
  double kv_memory_fraction = 0;
  int kv_block_tokens = 64;
  double peak_tflops = 0;
  std::string backend = "auto";
  int repeat = 1;
  SessionFlags session;
};

void DefineFlags(FlagSet& flags, PrefillFlags* f) {
  flags.String("model", &f->model,
               "a preset (tiny, llama3-8b, llama3-70b, llama3-405b; synthetic weights) or a "
               "Hugging Face checkpoint directory (config.json + safetensors)",
               true);
  flags.IntList("prompt-lens", &f->prompt_lens, "synthetic prompts of these lengths")
      .Within({1, kMaxTokens});
  flags.String("tokens", &f->tokens_file,
               "a JSON list of lists of token ids (instead of --prompt-lens)");
  flags.Int("layers", &f->layers, "run only the first K layers (0: all)").Within({0, 1e6});
  AddSelectorFlags(flags, &f->selector);
  flags.Bool("check", &f->check,
             "compare last-position logits and first tokens with a one-rank run");
  flags.Double("tolerance", &f->tolerance, "max abs logit difference --check accepts")
      .Within(Range::Above(0));
  flags.String("json", &f->json_file, "write the report as JSON to this file");
  flags.String("save-logits", &f->logits_file,
               "write the last-position logits [sequences, vocab] and first tokens as "
               "safetensors");
  flags.String("trace", &f->trace_file,
               "write the last run's timeline, every rank, as Chrome trace-event JSON (Perfetto): "
               "each layer's norms, GEMMs, RoPE, KV cache, attention ring and all-reduces");
  flags.Int("seed", &f->seed, "seed of synthetic weights and prompts").Within(Range::AtLeast(0));
  flags
      .Int("kv-capacity-tokens", &f->kv_capacity_tokens,
           "KV cache capacity per rank, in tokens (every layer's K and V), allocated at start-up "
           "(0: what this run's prompts need)")
      .Within({0, kMaxTokens});
  flags
      .Double("kv-memory-fraction", &f->kv_memory_fraction,
              "instead of --kv-capacity-tokens: this fraction of the rank's free memory (after "
              "the weights) for the KV cache")
      .Within({0, 1});
  flags.Int("kv-block-tokens", &f->kv_block_tokens, "tokens per KV cache block").Within({16, 256});
  flags
      .Double("peak-tflops", &f->peak_tflops,
              "peak dense TFLOP/s of one rank, for model FLOPs utilisation (0: not shown)")
      .Within(Range::AtLeast(0));
  flags
      .Int("repeat", &f->repeat,
           "timed prefills of the batch after one untimed warm-up when > 1 (median reported)")
      .Within({1, 1e6});
  flags.String("backend", &f->backend,
               "auto | cpu | cuda (auto: cuda when every rank sees a GPU); cuda computes in "
               "bf16 and --check compares with the fp32 CPU model at a relative tolerance");
  AddSessionFlags(flags, &f->session);
}

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
absl::Status PlanInputs(const PrefillFlags& f, int tp_size, runtime::ModelConfig* config,
                        std::vector<runtime::PrefillRequest>* batch) {
  CPFILL_ASSIGN_OR_RETURN(*config, runtime::LoadModelConfig(f.model));
  CPFILL_CHECK_ARG(f.layers >= 0, "--layers must be >= 0");
  CPFILL_CHECK_ARG(f.repeat >= 1, "--repeat must be >= 1");
  // A cut longer than the model would silently run all of it: the user asked for something
  // this model cannot give.
  CPFILL_CHECK_ARG(f.layers <= config->num_layers, "--layers ", f.layers, ": the model has only ",
                   config->num_layers, " layers");
  if (f.layers > 0) config->num_layers = f.layers;
  CPFILL_RETURN_IF_ERROR(config->ValidateForTp(tp_size));
  CPFILL_CHECK_ARG(f.prompt_lens.empty() != f.tokens_file.empty(),
                   "give exactly one of --prompt-lens and --tokens");
  if (!f.tokens_file.empty()) {
    CPFILL_ASSIGN_OR_RETURN(*batch, ReadTokensFile(f.tokens_file));
    return absl::OkStatus();
  }
  for (int64_t n : f.prompt_lens) {
    CPFILL_CHECK_ARG(n > 0, "--prompt-lens: every prompt needs at least one token, got ", n);
  }
  *batch = SyntheticPrompts(f.prompt_lens, config->vocab_size, static_cast<uint64_t>(f.seed));
  return absl::OkStatus();
}

runtime::PrefillOptions OptionsFrom(const PrefillFlags& f, const SelectorChoice& choice,
                                    const std::vector<runtime::PrefillRequest>& batch, int cp_size,
                                    int threads) {
  runtime::PrefillOptions o = ModelOptions(choice);
  o.kv_capacity_tokens = f.kv_capacity_tokens;
  o.kv_memory_fraction = f.kv_memory_fraction;
  o.kv_block_tokens = f.kv_block_tokens;
  if (f.kv_capacity_tokens == 0 && f.kv_memory_fraction == 0) {
    o.kv_capacity_tokens = runtime::KvTokensForBatch(batch, cp_size, o.kv_block_tokens);
  }
  o.threads = threads;
  return o;
}

// With --repeat > 1 a warm-up run goes first (library handles, lazily loaded kernels); the
// median of the timed runs' slowest-rank times is returned. The batch holds no session, so the
// runs are identical.
absl::StatusOr<double> PrefillRepeated(Session& session, runtime::LlamaModel& model,
                                       parallel::Communicator& world,
                                       const std::vector<runtime::PrefillRequest>& batch,
                                       int repeat, runtime::PrefillTimings* t,
                                       std::vector<runtime::SequenceOutput>* out) {
  const int layers = model.config().num_layers;
  auto progress = [&](int layer) {
    if (layers >= 8 && (layer + 1) % std::max(1, layers / 8) == 0) {
      session.Print("  layer %d/%d done\n", layer + 1, layers);
    }
  };
  std::vector<double> times;
  for (int r = (repeat > 1 ? -1 : 0); r < repeat; ++r) {
    CPFILL_ASSIGN_OR_RETURN(
        *out,
        model.Prefill(batch, t, r == repeat - 1 ? std::function<void(int)>(progress) : nullptr));
    double slowest = t->total_s;
    CPFILL_RETURN_IF_ERROR(
        world.AllReduce(&slowest, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMax));
    if (r >= 0) times.push_back(slowest);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::string Ms1(double s) { return absl::StrFormat("%.1f", s * 1e3); }

void PrintTimes(Session& session, const runtime::PrefillTimings& t, double ttft, int repeat,
                int64_t tokens, int world_size, double peak_tflops) {
  session.Print(
      "TTFT %s ms (slowest rank, median of %d run(s)); world rank 0, last run: GEMMs %s, "
      "attention ring %s, all-reduce %s, KV cache %s, LM head %s, embedding %s, other %s ms\n",
      Ms1(ttft), repeat, Ms1(t.gemm_s), Ms1(t.attention_s), Ms1(t.allreduce_s), Ms1(t.kv_s),
      Ms1(t.lm_head_s), Ms1(t.embed_s), Ms1(t.other_s));
  const double per_rank = t.model_flops / ttft / world_size;
  session.Print("%.0f tokens/s; %.3g model TFLOP, %.3g TFLOP/s per rank", tokens / ttft,
                t.model_flops / 1e12, per_rank / 1e12);
  if (peak_tflops > 0) session.Print(", MFU %.1f%%", 100 * per_rank / (peak_tflops * 1e12));
  session.Print("\n");
}

// The check runs on world rank 0; every rank learns the verdict.
PrefillCheck CheckOnRoot(Session& session, const PrefillFlags& f,
                         const runtime::ModelConfig& config,
                         const std::vector<runtime::PrefillRequest>& batch,
                         const std::vector<runtime::SequenceOutput>& out,
                         const runtime::PrefillOptions& options, bool bf16,
                         parallel::Communicator& world) {
  PrefillCheck check;
  check.pass = session.VerdictFromRoot(world, [&] {
    session.Print("check: prefilling the same batch on one rank (CPU, fp32)...\n");
    auto weights = MakeWeights(config, f.model, static_cast<uint64_t>(f.seed), 0, 1);
    if (!weights.ok()) session.Fail(weights.status());
    auto c =
        CheckPrefillOnOneRank(config, std::move(*weights), batch, out, options, bf16, f.tolerance);
    if (!c.ok()) session.Fail(c.status());
    check = *c;
    session.Print(
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
void WriteTrace(Session& session, const std::string& path, const runtime::PrefillTimings& t,
                const parallel::ProcessGrid& grid) {
  parallel::RingTimings timeline;
  timeline.start_unix_s = t.spans_origin_unix_s;
  timeline.spans.assign(t.spans.begin(), t.spans.end());
  auto ranks = GatherRankSteps(timeline, grid, 0);
  if (!ranks.ok()) session.Fail(ranks.status());
  if (!session.is_root()) return;
  if (absl::Status s = json::WriteFile(path, ChromeTrace(*ranks)); !s.ok()) {
    session.Fail(absl::Status(s.code(), absl::StrCat("--trace: ", s.message())));
  }
  session.Print("wrote the timeline of every rank's last run to %s (Perfetto, chrome://tracing)\n",
                path);
}

nlohmann::ordered_json Report(const PrefillFlags& f, const runtime::ModelConfig& config,
                              const parallel::ProcessGrid& grid,
                              const std::vector<runtime::PrefillRequest>& batch,
                              const std::vector<runtime::SequenceOutput>& out,
                              const runtime::PrefillTimings& t, double ttft, int64_t tokens,
                              const runtime::KvUsage& kv) {
  nlohmann::ordered_json seqs = nlohmann::ordered_json::array();
  for (size_t s = 0; s < out.size(); ++s) {
    seqs.push_back({{"tokens", static_cast<int64_t>(batch[s].tokens.size())},
                    {"first_token", out[s].first_token},
                    {"algorithm", parallel::RingAlgorithmName(t.algorithms[s])},
                    {"selector", t.selections[s].reason}});
  }
  return {{"command", "prefill"},
          {"model", config.name},
          {"layers", config.num_layers},
          {"world_size", grid.world_size},
          {"tp", grid.tp_size},
          {"cp", grid.cp_size},
          {"backend", f.backend},
          {"algorithm", parallel::AlgorithmsName(t.algorithms)},
          {"rings", t.rings},
          {"sequences", std::move(seqs)},
          {"ttft_ms", ttft * 1e3},
          {"gemm_ms", t.gemm_s * 1e3},
          {"attention_ms", t.attention_s * 1e3},
          {"allreduce_ms", t.allreduce_s * 1e3},
          {"kv_cache_ms", t.kv_s * 1e3},
          {"lm_head_ms", t.lm_head_s * 1e3},
          {"other_ms", (t.other_s + t.embed_s) * 1e3},
          {"host_plan_ms", t.host_plan_s * 1e3},
          {"host_enqueue_ms", t.host_enqueue_s * 1e3},
          {"tokens_per_s", tokens / ttft},
          {"model_tflop", t.model_flops / 1e12},
          {"kv_cache",
           {{"blocks_total", kv.blocks_total},
            {"block_tokens", f.kv_block_tokens},
            {"bytes_total", kv.bytes_total}}}};
}

int Run(int argc, char** argv) {
  // Parse.
  PrefillFlags f;
  FlagSet flags("prefill",
                "prefill a Llama-3 family model with TP inside nodes and CP across them; prints "
                "the first token per sequence and the time to first token (under mpirun)");
  DefineFlags(flags, &f);
  const absl::Status parsed = flags.Parse(argc, argv, 2);
  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session& session = *started.session;
  parallel::ProcessGrid& grid = *started.grid;
  if (auto bad = session.CheckOutputs(
          {{"json", f.json_file}, {"save-logits", f.logits_file}, {"trace", f.trace_file}})) {
    return *bad;
  }

  // Plan: backend (every rank must see a GPU for cuda), geometry, prompts, options.
  auto backend = ResolveBackendName(f.backend, {"cpu", "cuda"}, *grid.world);
  if (!backend.ok()) return session.Refuse(backend.status());
  f.backend = *backend;
  const bool bf16 = f.backend == "cuda";
  if (bf16 && !flags.IsSet("tolerance")) f.tolerance = 3e-2;  // relative, for bf16
  runtime::ModelConfig config;
  std::vector<runtime::PrefillRequest> batch;
  if (absl::Status s = PromptsFit(f, *grid.world); !s.ok()) return session.Refuse(s);
  if (absl::Status s = PlanInputs(f, grid.tp_size, &config, &batch); !s.ok()) {
    return session.ConfigError(s);
  }
  auto choice = ResolveSelector(f.selector, flags, RingContextOf(f.backend, grid));
  if (!choice.ok()) return session.Refuse(choice.status());
  runtime::PrefillOptions options =
      OptionsFrom(f, *choice, batch, grid.cp_size, session.ThreadsPerRank(grid));
  options.record_spans = !f.trace_file.empty();
  auto weights = LoadWeightsAgreed(config, f.model, static_cast<uint64_t>(f.seed), grid);
  if (!weights.ok()) return session.ConfigError(weights.status());
  auto loaded =
      BuildModel(config, std::move(*weights), f.backend, grid, session.mpi().options(), options);
  if (!loaded.ok()) return session.Refuse(loaded.status());
  runtime::LlamaModel& model = *loaded->model;
  int64_t tokens = 0;
  for (const auto& r : batch) tokens += r.tokens.size();
  session.Print(
      "cpfill prefill: %s (%d layers, hidden %d, %d/%d heads, %.3g B parameters), %d "
      "sequence(s), %d tokens\n",
      config.name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
      config.ParameterCount() / 1e9, batch.size(), tokens);
  session.Print("grid: %s; %s backend, %d thread(s) per rank; KV cache %d blocks of %d tokens\n",
                grid.Describe(), bf16 ? "CUDA (bf16, cuBLASLt, device ring on NCCL)" : "CPU (fp32)",
                options.threads, model.kv_usage().blocks_total, options.kv_block_tokens);

  // Run.
  runtime::PrefillTimings t;
  std::vector<runtime::SequenceOutput> out;
  auto timed = PrefillRepeated(session, model, *grid.world, batch, f.repeat, &t, &out);
  if (!timed.ok()) return session.Refuse(timed.status());
  const double ttft = *timed;

  // Report.
  session.Print("selector (%s), the batch as one: %s\n", parallel::SelectorRuleName(options.rule),
                t.selection.reason);
  session.Print("algorithm: %s (%d ring(s) per layer)\n", parallel::AlgorithmsName(t.algorithms),
                t.rings);
  for (size_t s = 0; s < out.size(); ++s) {
    session.Print("sequence %d: %d tokens, first token %d; %s\n", s, batch[s].tokens.size(),
                  out[s].first_token, t.selections[s].reason);
  }
  PrintTimes(session, t, ttft, f.repeat, tokens, grid.world_size, f.peak_tflops);
  PrefillCheck check;
  if (f.check) check = CheckOnRoot(session, f, config, batch, out, options, bf16, *grid.world);
  if (session.is_root() && !f.logits_file.empty()) {
    if (absl::Status s = SaveLogits(f.logits_file, out, config.vocab_size); !s.ok()) {
      session.Fail(s);
    }
    session.Print("saved logits to %s\n", f.logits_file);
  }
  if (!f.trace_file.empty()) WriteTrace(session, f.trace_file, t, grid);
  if (session.is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json report =
        Report(f, config, grid, batch, out, t, ttft, tokens, model.kv_usage());
    if (f.check) {
      report["check"] = {{"max_abs_logit_diff", check.max_abs_diff},
                         {"first_token_mismatches", check.token_mismatches},
                         {"pass", check.pass}};
    }
    session.WriteReport(f.json_file, std::move(report));
  }
  return f.check && !check.pass ? kExitCheckFailed : kExitOk;
}

}  // namespace

int RunPrefillCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
