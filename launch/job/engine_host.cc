#include "launch/job/engine_host.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "launch/job/backend.h"

namespace cpfill::launch {

KvDefault EngineKvDefault() { return {.unsized = "half the free memory"}; }

void AddEngineFlags(FlagSet& flags, EngineFlags* f, const KvDefault& kv_default) {
  AddModelFlags(flags, &f->model);
  flags.Int("max-batch-tokens", &f->max_batch_tokens, "new tokens in one fused batch")
      .Within({1, kMaxTokens});
  flags.Int("max-queue", &f->max_queue, "prompts waiting before requests are refused (503)")
      .Within({1, 1e7});
  flags
      .Int("max-running-requests", &f->max_running,
           "sequences generating at once (one decode batch); more wait in the queue")
      .Within({1, 65536});
  AddKvFlags(flags, &f->kv, kv_default);
  flags.Bool("no-prefix-cache", &f->no_prefix_cache,
             "keep no prompt's KV for later requests that start the same way (the prefix cache "
             "is on by default)");
  flags.Bool("batch-invariant", &f->batch_invariant,
             "CPU backend: every token's logits independent of its batch, bit for bit (a prompt "
             "after a cached prefix equals it prefilled whole, on one rank); slow, for checks");
  flags.Bool("no-prefix-batching", &f->no_prefix_batching,
             "decode steps read a shared prompt's KV once per sequence instead of once for all "
             "the sequences that share it (prefix-batched attention is on by default)");
  AddSelectorFlags(flags, &f->selector);
}

namespace {

// The share of a rank's free memory an unsized KV cache gets (EngineKvDefault's help says it).
constexpr double kUnsizedKvMemoryFraction = 0.5;

// runtime::Engine's sampling pool on world rank 0: at most 8 threads (engine.cc's constructor).
constexpr int kEngineSamplerThreads = 8;

// Every rank tries, with its KV cache allocated, the threads it will start next: on world rank 0
// the engine's sampling pool and the command's (front_threads), elsewhere none. The pools that
// start them cannot report a refused thread: the process would end there.
absl::Status CheckEngineThreads(const EngineFlags& f, const parallel::ProcessGrid& grid) {
  const bool root = grid.world_rank == 0;
  const int threads = root ? kEngineSamplerThreads + f.front_threads : 0;
  std::string what = absl::StrCat("the engine's ", kEngineSamplerThreads, " sampling threads");
  if (f.front_threads > 0) {
    absl::StrAppend(&what, " and the command's ", f.front_threads, " (", f.front_threads_flag,
                    " and its own)");
  }
  std::string remedy = "lower --kv-memory-fraction or --kv-capacity-tokens";
  if (!f.front_threads_flag.empty()) absl::StrAppend(&remedy, ", or ", f.front_threads_flag);
  return CheckThreadsStartOnEveryRank(*grid.world, threads, what, remedy);
}

absl::Status CheckBatchInvariant(const EngineFlags& f, const std::string& backend) {
  CPFILL_CHECK_ARG(!(f.batch_invariant && backend == "cuda"),
                   "--batch-invariant: the CUDA backend's kernels are not batch-invariant (use "
                   "--backend cpu)");
  return absl::OkStatus();
}

runtime::StepOptions OptionsFrom(const EngineFlags& f, const SelectorChoice& choice, int threads) {
  runtime::StepOptions o = ModelOptions(choice);
  f.kv.SetOptions(&o);
  if (!f.kv.sized()) o.kv_memory_fraction = kUnsizedKvMemoryFraction;
  o.prefix_batching = !f.no_prefix_batching;
  o.batch_invariant = f.batch_invariant;
  o.threads = threads;
  return o;
}

// The checkpoint's tokenizer, if it has one cpfill can read. Every rank reads it (one verdict),
// though only rank 0 tokenizes. A file cpfill cannot read (another tokenizer family, a malformed
// file) does not stop a job whose prompts are token ids: it is named on rank 0's stderr and kept
// in `host->tokenizer_status`, and text is refused. Ids past the model's vocabulary are refused:
// the tokenizer belongs to another model.
absl::Status TokenizerFor(const EngineFlags& f, const runtime::ModelConfig& config, bool is_root,
                          EngineHost* host) {
  if (runtime::IsPreset(f.model.name)) return absl::OkStatus();
  absl::StatusOr<runtime::Tokenizer> tokenizer = runtime::Tokenizer::Load(f.model.name);
  if (absl::IsNotFound(tokenizer.status())) return absl::OkStatus();
  if (!tokenizer.ok()) {
    host->tokenizer_status = tokenizer.status();
    if (is_root) {
      std::fprintf(stderr, "cpfill: warning: no tokenizer, token ids only: %s\n",
                   std::string(tokenizer.status().message()).c_str());
    }
    return absl::OkStatus();
  }
  CPFILL_CHECK_ARG(tokenizer->vocab_size() <= config.vocab_size, f.model.name,
                   "/tokenizer.json has ids up to ", tokenizer->vocab_size() - 1,
                   ", past the model's vocabulary of ", config.vocab_size);
  host->tokenizer = *std::move(tokenizer);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineHost>> BuildEngineHost(const EngineFlags& f,
                                                            const FlagSet& flags, Job& job,
                                                            const parallel::ProcessGrid& grid,
                                                            runtime::EngineOptions options) {
  auto host = std::make_unique<EngineHost>();
  // Named cuda: refused before the GPUs are looked for; auto: once it is resolved.
  CPFILL_RETURN_IF_ERROR(CheckBatchInvariant(f, f.model.backend));
  CPFILL_ASSIGN_OR_RETURN(host->backend,
                          ResolveBackendName(f.model.backend, {"cpu", "cuda"}, *grid.world));
  CPFILL_RETURN_IF_ERROR(CheckBatchInvariant(f, host->backend));
  CPFILL_ASSIGN_OR_RETURN(host->config, ModelConfigFor(f.model, grid.tp_size));
  CPFILL_RETURN_IF_ERROR(TokenizerFor(f, host->config, job.is_root(), host.get()));
  CPFILL_ASSIGN_OR_RETURN(SelectorChoice choice,
                          ResolveSelector(f.selector, flags, RingContextOf(host->backend, grid)));
  const runtime::StepOptions model_options = OptionsFrom(f, choice, job.ThreadsPerRank(grid));
  CPFILL_ASSIGN_OR_RETURN(
      runtime::ModelWeights weights,
      LoadWeightsAgreed(host->config, f.model.name, static_cast<uint64_t>(f.model.seed), grid));
  CPFILL_ASSIGN_OR_RETURN(host->loaded, BuildModel(host->config, std::move(weights), host->backend,
                                                   grid, job.mpi().options(), model_options));
  CPFILL_RETURN_IF_ERROR(CheckEngineThreads(f, grid));
  options.max_batch_tokens = f.max_batch_tokens;
  options.max_queue = f.max_queue;
  options.max_running = f.max_running;
  options.prefix_cache = !f.no_prefix_cache;
  // Generation stops at the checkpoint's EOS ids, else at its tokenizer's.
  options.eos_ids = host->config.eos_token_ids;
  if (options.eos_ids.empty() && host->tokenizer && host->tokenizer->eos_id() >= 0) {
    options.eos_ids = {host->tokenizer->eos_id()};
  }
  // Idle ranks hear from rank 0 well within every wait's deadline, and an idle rank 0 starts a
  // heartbeat soon enough after a rank stops that the job still ends within the deadline + 1 s.
  const auto deadline =
      std::chrono::duration_cast<std::chrono::milliseconds>(job.mpi().options().timeout);
  options.heartbeat =
      std::min<std::chrono::milliseconds>(std::chrono::milliseconds(500), deadline / 8);
  host->engine = std::make_unique<runtime::Engine>(*host->loaded.model, *grid.world, options);
  return host;
}

}  // namespace cpfill::launch
