// cpfill/launch/job/model_flags.h — the flags of every command that holds a Llama model, declared
// once: `prefill`, and the engine's commands (`generate`, `serve`, the C API's engine;
// engine_host.h). ModelFlags: which model, cut to how many layers, with which synthetic seed,
// on which backend. KvFlags: its KV cache's size and block.
//
// The flags mean the same in every command but one thing: what a KV cache gets when neither
// --kv-capacity-tokens nor --kv-memory-fraction sizes it. Each command chooses (`prefill`: what
// its prompts need; `generate`: what its batch needs; `serve`: half the free memory), says so
// in a KvDefault that the flags' help shows, and applies it before building the model.
//
//   ModelFlags model;  KvFlags kv;
//   AddModelFlags(flags, &model);
//   AddKvFlags(flags, &kv, {.unsized = "what this run's prompts need"});
//   ...parse...
//   CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, ModelConfigFor(model, grid.tp_size));
//   if (!kv.sized()) kv.capacity_tokens = runtime::KvTokensForBatch(batch, cp, kv.block_tokens);
//   kv.SetOptions(&options);
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "launch/job/flags.h"
#include "runtime/model/model_config.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill::launch {

struct ModelFlags {
  std::string name;              // --model: a preset's name or a Hugging Face checkpoint directory
  std::string backend = "auto";  // auto | cpu | cuda
  int layers = 0;                // the first K layers only; 0: all
  int64_t seed = 1;              // of a preset's synthetic weights (and synthetic prompts)
  std::string quantize;          // --quantize: "" (as stored), fp8-rowwise[:ffn|all], none
};

// --model (required), --layers, --seed, --backend, --quantize.
void AddModelFlags(FlagSet& flags, ModelFlags* model_flags);

// The model's geometry, cut to --layers and checked against the TP size: bad input, the same on
// every rank (InvalidArgument naming --layers or the model; NotFound for a missing checkpoint).
absl::StatusOr<runtime::ModelConfig> ModelConfigFor(const ModelFlags& model_flags, int tp_size);

// --quantize into config->fp8 (empty: leave it as config.json says). InvalidArgument naming the
// flag for an unknown scheme.
absl::Status ApplyQuantizeFlag(const std::string& flag, runtime::ModelConfig* config);

struct KvFlags {
  int64_t capacity_tokens = 0;  // per rank, every layer's K and V; 0: not given
  double memory_fraction = 0;   // of the rank's free memory after the weights; 0: not given
  int block_tokens = 64;

  // Whether either size was given; if not, the command's KvDefault applies.
  bool sized() const { return capacity_tokens != 0 || memory_fraction != 0; }
  // The cache's size and block into a model's options (the rest left as they are).
  void SetOptions(runtime::StepOptions* options) const;
};

// The most of a rank's free memory --kv-memory-fraction may give the KV cache: all of it would
// leave nothing for the activations and for threads the process starts afterwards (the engine's,
// the HTTP server's), whose stacks a refused allocation would end with an uncaught exception.
inline constexpr double kMaxKvMemoryFraction = 0.9;

// A command's own KV cache when the flags leave it unsized, for the help of the size flags.
struct KvDefault {
  std::string unsized;  // e.g. "what this run's prompts need"
  // Whether --kv-memory-fraction 0 is taken (as "not given": `prefill`) or refused (the engine's
  // commands, which take (0, kMaxKvMemoryFraction]).
  bool fraction_may_be_zero = false;
};

// --kv-capacity-tokens, --kv-memory-fraction, --kv-block-tokens.
void AddKvFlags(FlagSet& flags, KvFlags* kv_flags, const KvDefault& kv_default);

}  // namespace cpfill::launch
