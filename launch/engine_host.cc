#include "launch/engine_host.h"

#include <algorithm>
#include <chrono>

#include "base/status.h"
#include "launch/backend.h"

namespace cpfill::launch {

void AddEngineFlags(FlagSet& flags, EngineFlags* f) {
  flags.String("model", &f->model,
               "a preset (tiny, llama3-8b, llama3-70b, llama3-405b; synthetic weights) or a "
               "Hugging Face checkpoint directory",
               true);
  flags.Int("layers", &f->layers, "run only the first K layers (0: all)").Within({0, 1e6});
  flags.Int("seed", &f->seed, "seed of synthetic weights").Within(Range::AtLeast(0));
  flags.Int("max-batch-tokens", &f->max_batch_tokens, "new tokens in one fused batch")
      .Within({1, kMaxTokens});
  flags.Int("max-queue", &f->max_queue, "prompts waiting before requests are refused (503)")
      .Within({1, 1e7});
  flags
      .Int("max-running-requests", &f->max_running,
           "sequences generating at once (one decode batch); more wait in the queue")
      .Within({1, 65536});
  flags
      .Int("kv-capacity-tokens", &f->kv_capacity_tokens,
           "KV cache capacity per rank, in tokens, allocated at start-up (0: "
           "--kv-memory-fraction, else half the free memory)")
      .Within({0, kMaxTokens});
  flags
      .Double("kv-memory-fraction", &f->kv_memory_fraction,
              "instead of --kv-capacity-tokens: this fraction of the rank's free memory")
      .Within(Range::LeftOpen(0, 1));
  flags.Int("kv-block-tokens", &f->kv_block_tokens, "tokens per KV cache block").Within({16, 256});
  flags.Bool("no-prefix-cache", &f->no_prefix_cache,
             "keep no prompt's KV for later requests that start the same way (the prefix cache "
             "is on by default)");
  flags.Bool("batch-invariant", &f->batch_invariant,
             "CPU backend: every token's logits independent of its batch, bit for bit (a prompt "
             "after a cached prefix equals it prefilled whole, on one rank); slow, for checks");
  flags.Bool("no-prefix-batching", &f->no_prefix_batching,
             "decode steps read a shared prompt's KV once per sequence instead of once for all "
             "the sequences that share it (prefix-batched attention is on by default)");
  flags.String("backend", &f->backend, "auto | cpu | cuda (auto: cuda when every rank sees a GPU)");
  AddSelectorFlags(flags, &f->selector);
}

namespace {

// The model, cut to --layers, checked against the grid: bad input, the same on every rank.
absl::StatusOr<runtime::ModelConfig> ModelFor(const EngineFlags& f, int tp_size) {
  CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, runtime::LoadModelConfig(f.model));
  CPFILL_CHECK_ARG(f.layers <= config.num_layers, "--layers ", f.layers, ": the model has only ",
                   config.num_layers, " layers");
  if (f.layers > 0) config.num_layers = f.layers;
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp_size));
  return config;
}

absl::Status CheckBatchInvariant(const EngineFlags& f, const std::string& backend) {
  CPFILL_CHECK_ARG(!(f.batch_invariant && backend == "cuda"),
                   "--batch-invariant: the CUDA backend's kernels are not batch-invariant (use "
                   "--backend cpu)");
  return absl::OkStatus();
}

runtime::PrefillOptions OptionsFrom(const EngineFlags& f, const SelectorChoice& choice,
                                    int threads) {
  runtime::PrefillOptions o = ModelOptions(choice);
  o.kv_capacity_tokens = f.kv_capacity_tokens;
  o.kv_memory_fraction =
      f.kv_capacity_tokens == 0 && f.kv_memory_fraction == 0 ? 0.5 : f.kv_memory_fraction;
  o.kv_block_tokens = f.kv_block_tokens;
  o.prefix_batching = !f.no_prefix_batching;
  o.batch_invariant = f.batch_invariant;
  o.threads = threads;
  return o;
}

// The checkpoint's tokenizer, if it has one. Every rank reads it (one verdict for a malformed
// file, like config.json), though only rank 0 tokenizes.
absl::StatusOr<std::optional<runtime::Tokenizer>> TokenizerFor(const EngineFlags& f,
                                                               const runtime::ModelConfig& config) {
  if (runtime::IsPreset(f.model)) return std::nullopt;
  absl::StatusOr<runtime::Tokenizer> tokenizer = runtime::Tokenizer::Load(f.model);
  if (absl::IsNotFound(tokenizer.status())) return std::nullopt;
  CPFILL_RETURN_IF_ERROR(tokenizer.status());
  CPFILL_CHECK_ARG(tokenizer->vocab_size() <= config.vocab_size, f.model,
                   "/tokenizer.json has ids up to ", tokenizer->vocab_size() - 1,
                   ", past the model's vocabulary of ", config.vocab_size);
  return std::optional<runtime::Tokenizer>(std::move(*tokenizer));
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineHost>> BuildEngineHost(const EngineFlags& f,
                                                            const FlagSet& flags, Session& session,
                                                            const parallel::ProcessGrid& grid,
                                                            runtime::EngineOptions options) {
  auto host = std::make_unique<EngineHost>();
  // Named cuda: refused before the GPUs are looked for; auto: once it is resolved.
  CPFILL_RETURN_IF_ERROR(CheckBatchInvariant(f, f.backend));
  CPFILL_ASSIGN_OR_RETURN(host->backend,
                          ResolveBackendName(f.backend, {"cpu", "cuda"}, *grid.world));
  CPFILL_RETURN_IF_ERROR(CheckBatchInvariant(f, host->backend));
  CPFILL_ASSIGN_OR_RETURN(host->config, ModelFor(f, grid.tp_size));
  CPFILL_ASSIGN_OR_RETURN(host->tokenizer, TokenizerFor(f, host->config));
  CPFILL_ASSIGN_OR_RETURN(SelectorChoice choice,
                          ResolveSelector(f.selector, flags, RingContextOf(host->backend, grid)));
  const runtime::PrefillOptions model_options =
      OptionsFrom(f, choice, session.ThreadsPerRank(grid));
  CPFILL_ASSIGN_OR_RETURN(
      runtime::ModelWeights weights,
      LoadWeightsAgreed(host->config, f.model, static_cast<uint64_t>(f.seed), grid));
  CPFILL_ASSIGN_OR_RETURN(host->loaded, BuildModel(host->config, std::move(weights), host->backend,
                                                   grid, session.mpi().options(), model_options));
  options.max_batch_tokens = f.max_batch_tokens;
  options.max_queue = f.max_queue;
  options.max_running = f.max_running;
  options.prefix_cache = !f.no_prefix_cache;
  // Generation stops at the checkpoint's EOS ids, else at its tokenizer's.
  options.eos_ids = host->config.eos_token_ids;
  if (options.eos_ids.empty() && host->tokenizer && host->tokenizer->eos_id() >= 0) {
    options.eos_ids = {host->tokenizer->eos_id()};
  }
  // Idle ranks hear from rank 0 well within every wait's deadline.
  const auto deadline =
      std::chrono::duration_cast<std::chrono::milliseconds>(session.mpi().options().timeout);
  options.heartbeat =
      std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000), deadline / 4);
  host->engine = std::make_unique<runtime::Engine>(*host->loaded.model, *grid.world, options);
  return host;
}

}  // namespace cpfill::launch
