// `cpfill generate`: prefill and generate on the engine (TP inside nodes, CP across; decode
// steps as batched ring pass-Q, Alg. 4), one batch from the command line: prints each sequence's
// tokens (and text, with a tokenizer), the time to first token and per output token, and where
// the new tokens' KV went; --check compares every generated token with one rank teacher-forced
// on the same tokens. The engine is the one `serve` runs (engine_host.h).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/http/http_api.h"
#include "launch/job/engine_host.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/model_setup.h"
#include "launch/job/prefill_check.h"
#include "runtime/serving/engine.h"

namespace cpfill::launch {
namespace {

struct GenerateFlags {
  EngineFlags engine;
  std::vector<int64_t> prompt_lens;
  std::string tokens_file, text;
  int max_tokens = 16;
  runtime::SamplingParams sampling;
  int64_t sample_seed = 0;
  bool ignore_eos = false, check = false;
  double tolerance = 1e-3;
  std::string json_file;
  std::string sparq;  // "r,k[,l]": decode with SparQ
  std::optional<attention::sparq::SparqConfig> parsed_sparq;
};

// --tokens and --text are read after the engine is built: their KV cache, unsized, gets this.
constexpr int64_t kUnsizedKvTokens = 1 << 16;

void DefineFlags(FlagSet& flags, GenerateFlags* f) {
  AddEngineFlags(flags, &f->engine,
                 {.unsized = absl::StrCat("what --prompt-lens and --max-tokens need, or ",
                                          kUnsizedKvTokens, " tokens for --tokens and --text")});
  flags.IntList("prompt-lens", &f->prompt_lens, "synthetic prompts of these lengths (from --seed)")
      .Within({1, kMaxTokens});
  flags.String("tokens", &f->tokens_file, "a JSON list of lists of token ids");
  flags.String("text", &f->text, "one text prompt (needs the checkpoint's tokenizer; BOS added)");
  flags.Int("max-tokens", &f->max_tokens, "tokens to generate per sequence").Within({1, 1 << 20});
  flags.Double("temperature", &f->sampling.temperature, "0: greedy").Within({0, 100});
  flags.Double("top-p", &f->sampling.top_p, "nucleus sampling").Within(Range::LeftOpen(0, 1));
  flags.Int("top-k", &f->sampling.top_k, "0: every token").Within({0, 1e9});
  flags.Int("sample-seed", &f->sample_seed, "seed of sampling (sequence i uses seed + i)")
      .Within(Range::AtLeast(0));
  flags.Bool("ignore-eos", &f->ignore_eos, "generate --max-tokens even past EOS");
  flags.Bool("check", &f->check, "compare every generated token with one rank (greedy only)");
  flags
      .Double("tolerance", &f->tolerance,
              "max abs logit difference --check accepts (cuda: relative to the logits' scale, "
              "default 3e-2)")
      .Within(Range::Above(0));
  flags.String("json", &f->json_file, "write the report as JSON to this file").Output();
  flags.String("sparq", &f->sparq,
               "r,k[,l]: decode with SparQ attention (r of head_dim components rank positions, the "
               "top k attended, the last l always; CPU backend); prefill stays dense");
}

// --sparq "r,k[,l]" against the model's head dim; nullopt when not given.
absl::StatusOr<std::optional<attention::sparq::SparqConfig>> SparqFromFlag(const std::string& text,
                                                                           int head_dim) {
  if (text.empty()) return std::nullopt;
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  std::vector<int> v;
  for (const std::string& p : parts) {
    int x = 0;
    CPFILL_CHECK_ARG(absl::SimpleAtoi(p, &x), "--sparq ", text, ": '", p,
                     "' is not an integer (give r,k[,l])");
    v.push_back(x);
  }
  CPFILL_CHECK_ARG(v.size() == 2 || v.size() == 3, "--sparq ", text, ": give r,k[,l]");
  attention::sparq::SparqConfig c{.r = v[0], .k = v[1], .local_window = v.size() == 3 ? v[2] : 0};
  if (absl::Status s = runtime::CheckSparqConfig(c, head_dim); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--sparq ", text, ": ", s.message()));
  }
  return c;
}

// The whole batch is queued at once (RunEngine): more prompts than --max-queue holds would be
// refused by the engine after the model is built, on rank 0 alone.
absl::Status CheckFitsQueue(size_t prompts, const GenerateFlags& f) {
  CPFILL_CHECK_ARG(prompts <= static_cast<size_t>(f.engine.max_queue), "--max-queue ",
                   f.engine.max_queue, ": the queue holds fewer than the ", prompts,
                   " prompts, which are queued at once; raise it to ", prompts, " or more");
  return absl::OkStatus();
}

// The prompts, the same on every rank: bad input alike everywhere.
absl::StatusOr<std::vector<runtime::PrefillRequest>> Prompts(const GenerateFlags& f,
                                                             const EngineHost& host) {
  const int given = !f.prompt_lens.empty() + !f.tokens_file.empty() + !f.text.empty();
  CPFILL_CHECK_ARG(given == 1, "give exactly one of --prompt-lens, --tokens and --text");
  CPFILL_CHECK_ARG(!f.check || f.sampling.temperature == 0,
                   "--check compares greedy generations: --temperature 0");
  if (!f.tokens_file.empty()) {
    CPFILL_ASSIGN_OR_RETURN(std::vector<runtime::PrefillRequest> prompts,
                            ReadTokensFile(f.tokens_file));
    CPFILL_RETURN_IF_ERROR(CheckFitsQueue(prompts.size(), f));
    return prompts;
  }
  if (!f.prompt_lens.empty()) {
    return SyntheticPrompts(f.prompt_lens, host.config.vocab_size,
                            static_cast<uint64_t>(f.engine.model.seed));
  }
  CPFILL_CHECK_ARG(host.tokenizer.has_value(), "--text needs the model's tokenizer (",
                   f.engine.model.name,
                   host.tokenizer_status.ok() ? " has no tokenizer.json"
                                              : absl::StrCat(": ", host.tokenizer_status.message()),
                   "); give --tokens");
  CPFILL_ASSIGN_OR_RETURN(std::vector<int32_t> ids, host.tokenizer->Encode(f.text, true));
  return std::vector<runtime::PrefillRequest>{{.tokens = std::move(ids)}};
}

// Every rank runs the engine's loop. Rank 0 queues the whole batch first and asks for the
// shutdown at once: the loop drains the queue, generates to the end and then returns (no thread
// of its own, so nothing is started once the KV cache took the memory it was given).
absl::StatusOr<std::vector<runtime::EngineResult>> RunEngine(
    const GenerateFlags& f, EngineHost& host, bool root,
    const std::vector<runtime::PrefillRequest>& prompts) {
  runtime::Engine& engine = *host.engine;
  absl::StatusOr<std::vector<runtime::Engine::Reply>> replies =
      std::vector<runtime::Engine::Reply>{};
  if (root) {
    std::vector<runtime::EngineRequest> requests;
    for (size_t i = 0; i < prompts.size(); ++i) {
      runtime::EngineRequest r{.tokens = prompts[i].tokens,
                               .max_tokens = f.max_tokens,
                               .sampling = f.sampling,
                               .ignore_eos = f.ignore_eos,
                               .return_logits = f.check};  // the check compares them
      r.sparq = f.parsed_sparq;
      r.sampling.seed = static_cast<uint64_t>(f.sample_seed) + i;
      requests.push_back(std::move(r));
    }
    replies = engine.SubmitAll(std::move(requests));
    engine.Shutdown();
  }
  CPFILL_RETURN_IF_ERROR(engine.Run());
  CPFILL_RETURN_IF_ERROR(replies.status());
  std::vector<runtime::EngineResult> results;
  for (auto& reply : *replies) {
    CPFILL_ASSIGN_OR_RETURN(results.emplace_back(), reply.get());
  }
  return results;
}

std::string IdsText(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) absl::StrAppend(&s, s.empty() ? "" : " ", id);
  return s;
}

void PrintResults(Job& job, const EngineHost& host,
                  const std::vector<runtime::PrefillRequest>& prompts,
                  const std::vector<runtime::EngineResult>& results) {
  for (size_t s = 0; s < results.size(); ++s) {
    const runtime::EngineResult& r = results[s];
    job.Print("sequence %d: %d prompt tokens, %d generated (%s): %s\n", s, prompts[s].tokens.size(),
              r.tokens.size(), r.finish_reason, IdsText(r.token_ids()));
    if (host.tokenizer) {
      auto text = host.tokenizer->Decode(r.token_ids(), /*skip_special=*/false);
      if (text.ok()) job.Print("  text: %s\n", *text);
    }
    job.Print("  TTFT %.2f ms, TPOT %.3f ms (%d decode steps in %.2f ms)\n",
              (r.queue_s + r.prefill_s) * 1e3, r.tpot_s() * 1e3, r.tokens.size() - 1,
              r.decode_s * 1e3);
    const runtime::StepTimings& d = r.decode_timings;
    const double steps = std::max<double>(1, double(r.tokens.size()) - 1);
    job.Print(
        "  per decode step (world rank 0): model %.3f ms = GEMMs %.3f, attention ring %.3f, "
        "all-reduce %.3f, KV cache %.3f, LM head %.3f, other %.3f; host planning %.3f and "
        "enqueueing %.3f; engine and sampling %.3f ms\n",
        d.total_s / steps * 1e3, d.gemm_s / steps * 1e3, d.attention_s / steps * 1e3,
        d.allreduce_s / steps * 1e3, d.kv_s / steps * 1e3, d.lm_head_s / steps * 1e3,
        (d.other_s + d.embed_s) / steps * 1e3, d.host_plan_s / steps * 1e3,
        d.host_enqueue_s / steps * 1e3, (r.decode_s - d.total_s) / steps * 1e3);
  }
}

GenerationCheck CheckOnRoot(Job& job, const GenerateFlags& f, const EngineHost& host,
                            const std::vector<runtime::PrefillRequest>& prompts,
                            const std::vector<runtime::EngineResult>& results,
                            parallel::Communicator& world) {
  GenerationCheck check;
  const bool bf16 = host.backend == "cuda";
  check.pass = job.VerdictFromRoot(world, [&] {
    job.Print("check: the same tokens, teacher-forced on one rank (CPU, fp32)...\n");
    const ModelFlags& model = f.engine.model;
    auto weights = MakeWeights(host.config, model.name, static_cast<uint64_t>(model.seed), 0, 1);
    if (!weights.ok()) job.Fail(weights.status());
    std::vector<runtime::SequenceOutput> first;
    std::vector<std::vector<int32_t>> generated;
    for (const auto& r : results) {
      first.push_back({.logits = r.logits, .first_token = r.first_token});
      generated.push_back(r.token_ids());
    }
    runtime::StepOptions options;
    options.kv_block_tokens = f.engine.kv.block_tokens;
    auto c = CheckGenerationOnOneRank(host.config, std::move(*weights), prompts, first, generated,
                                      options, bf16, f.tolerance);
    if (!c.ok()) job.Fail(c.status());
    check = *c;
    job.Print(
        "check: prompt logits max |diff| %.3g (allowed %.3g); %d generated tokens, %d not the "
        "reference's argmax, %d of them near ties: %s\n",
        check.first.max_abs_diff, check.first.allowed, check.tokens,
        check.mismatches + check.near_ties, check.near_ties, check.pass ? "PASS" : "FAIL");
    return check.pass;
  });
  return check;
}

nlohmann::ordered_json Report(const GenerateFlags& f, const EngineHost& host,
                              const parallel::ProcessGrid& grid,
                              const std::vector<runtime::PrefillRequest>& prompts,
                              const std::vector<runtime::EngineResult>& results) {
  nlohmann::ordered_json seqs = nlohmann::ordered_json::array();
  for (size_t s = 0; s < results.size(); ++s) {
    const runtime::EngineResult& r = results[s];
    seqs.push_back({{"prompt_tokens", prompts[s].tokens.size()},
                    {"tokens", r.token_ids()},
                    {"finish_reason", r.finish_reason},
                    {"ttft_ms", (r.queue_s + r.prefill_s) * 1e3},
                    {"tpot_ms", r.tpot_s() * 1e3},
                    {"decode_ms", r.decode_s * 1e3},
                    {"decode_step_phases_ms", DecodePhasesMs(r.decode_timings)},
                    {"preemptions", r.preemptions},
                    {"sparq_decode_steps", r.sparq_decode_steps}});
  }
  return {{"command", "generate"},
          {"model", host.config.name},
          {"layers", host.config.num_layers},
          {"world_size", grid.world_size},
          {"tp", grid.tp_size},
          {"cp", grid.cp_size},
          {"backend", host.backend},
          {"max_tokens", f.max_tokens},
          {"temperature", f.sampling.temperature},
          {"sequences", std::move(seqs)}};
}

// Without a KV size, what the batch needs: each prompt's share and the decode steps' rows,
// which PlanDecode spreads over the CP ranks; --tokens and --text, not read yet, get
// kUnsizedKvTokens.
void SizeKvCache(GenerateFlags& f, int cp_size) {
  KvFlags& kv = f.engine.kv;
  if (kv.sized()) return;
  if (f.prompt_lens.empty()) {
    kv.capacity_tokens = kUnsizedKvTokens;
    return;
  }
  int64_t tokens = 0;
  for (int64_t n : f.prompt_lens) tokens += (n + f.max_tokens) / cp_size + 2 * kv.block_tokens;
  kv.capacity_tokens = tokens;
}

// The command once its job has started: plan (the engine, the prompts) -> run -> report.
int Generate(GenerateFlags& f, const FlagSet& flags, Job& job, const parallel::ProcessGrid& grid) {
  // --prompt-lens is counted before the model is built; --tokens once it is read (Prompts).
  if (absl::Status s = CheckFitsQueue(f.prompt_lens.size(), f); !s.ok()) {
    return job.ConfigError(s);
  }
  SizeKvCache(f, grid.cp_size);
  auto host = BuildEngineHost(f.engine, flags, job, grid, {});
  if (!host.ok()) return job.Refuse(host.status());
  if ((*host)->backend == "cuda" && !flags.IsSet("tolerance")) f.tolerance = 3e-2;  // relative
  auto sparq = SparqFromFlag(f.sparq, (*host)->config.head_dim);
  if (!sparq.ok()) return job.ConfigError(sparq.status());
  if (sparq->has_value() && (*host)->backend != "cpu") {
    return job.ConfigError(absl::InvalidArgumentError("sparq needs the CPU backend for now"));
  }
  f.parsed_sparq = *sparq;
  auto prompts = Prompts(f, **host);
  if (!prompts.ok()) return job.ConfigError(prompts.status());
  job.Print("cpfill generate: %s (%d layers), %d sequence(s), up to %d tokens each; %s; %s\n",
            (*host)->config.name, (*host)->config.num_layers, prompts->size(), f.max_tokens,
            grid.Describe(), (*host)->backend);

  // A request refused on rank 0 (it does not fit the KV cache, ...) ends every rank alike.
  auto results = RunEngine(f, **host, job.is_root(), *prompts);
  if (!job.VerdictFromRoot(*grid.world, [&] { return results.ok(); })) {
    return job.is_root() ? job.Refuse(results.status()) : kExitBadInput;
  }
  PrintResults(job, **host, *prompts, *results);
  GenerationCheck check;
  if (f.check) check = CheckOnRoot(job, f, **host, *prompts, *results, *grid.world);
  if (job.is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json report = Report(f, **host, grid, *prompts, *results);
    if (f.check) {
      report["check"] = {{"prompt_logits_max_abs_diff", check.first.max_abs_diff},
                         {"tokens", check.tokens},
                         {"mismatches", check.mismatches},
                         {"near_ties", check.near_ties},
                         {"pass", check.pass}};
    }
    job.WriteReport(f.json_file, std::move(report));
  }
  return f.check && !check.pass ? kExitCheckFailed : kExitOk;
}

}  // namespace

int RunGenerateCommand(int argc, char** argv) {
  GenerateFlags f;
  FlagSet flags("generate",
                "prefill prompts and generate tokens on the engine (TP inside nodes, CP across; "
                "decode as batched ring pass-Q); --check against one rank (under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
    return Generate(f, flags, job, grid);
  });
}

}  // namespace cpfill::launch
