// cpfill/launch/job/engine_host.h — the engine and what it stands on, built from flags on every
// rank: the model (a preset or a checkpoint, cut to --layers), its weights, the backend and the KV
// cache. `cpfill serve` puts an HTTP front on it; the C API (launch/embed/) hands it to a program.
//
//   EngineFlags ef;  AddEngineFlags(flags, &ef);   ...parse...
//   CPFILL_ASSIGN_OR_RETURN(auto host, BuildEngineHost(ef, flags, job, grid, {}));
//   std::thread loop([&] { host->engine->Run(); });
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/model_flags.h"
#include "launch/job/model_setup.h"
#include "launch/job/selector_flags.h"
#include "runtime/model/model_config.h"
#include "runtime/serving/engine.h"
#include "runtime/text/tokenizer.h"

namespace cpfill::launch {

struct EngineFlags {
  ModelFlags model;
  KvFlags kv;  // unsized: EngineKvDefault(), unless the command sizes it first
  int64_t max_batch_tokens = 131072;
  int max_queue = 1024;
  int max_running = 256;
  bool no_prefix_cache = false;
  bool no_prefix_batching = false;
  bool batch_invariant = false;
  SelectorFlags selector;
  // Not flags: threads the command itself starts on world rank 0 once the engine is built (serve:
  // its HTTP pool and two more), and the flag that sets them. BuildEngineHost tries them with the
  // engine's own once the KV cache holds its memory, so that a number the system cannot start
  // is refused (exit 2) instead of ending the process where they are made.
  int front_threads = 0;
  std::string front_threads_flag;
};

// What the engine gives a KV cache the flags leave unsized (`serve`, the C API): half the rank's
// free memory.
KvDefault EngineKvDefault();

// The engine's flags: the model's (model_flags.h), the batch and queue bounds, the KV cache's
// (`kv_default`: what an unsized one gets, for the help: a command that sizes it itself, as
// `generate` does, says how), the prefix cache's and the selector's.
void AddEngineFlags(FlagSet& flags, EngineFlags* engine_flags,
                    const KvDefault& kv_default = EngineKvDefault());

// Members end in reverse order: the engine before the model it runs.
struct EngineHost {
  std::string backend;  // resolved: cpu or cuda
  runtime::ModelConfig config;
  LoadedModel loaded;
  std::unique_ptr<runtime::Engine> engine;
  // A checkpoint's tokenizer.json (and tokenizer_config.json); none for presets, checkpoints
  // without one, and ones cpfill cannot read (they take token ids only; `tokenizer_status` says
  // why a present file was not loaded, OK otherwise).
  std::optional<runtime::Tokenizer> tokenizer;
  absl::Status tokenizer_status;
};

// Collective. `options` brings what the caller adds (on_batch); the bounds come from the flags
// and the heartbeat from the job's deadline. Bad input fails alike on every rank
// (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted), also a checkpoint that only
// some ranks cannot read (LoadWeightsAgreed), a tokenizer.json with ids past the model's
// vocabulary, and threads that some rank cannot start once its KV cache is allocated
// (ResourceExhausted naming the rank and the flags that make them fit: --kv-memory-fraction,
// EngineFlags::front_threads_flag).
absl::StatusOr<std::unique_ptr<EngineHost>> BuildEngineHost(const EngineFlags& engine_flags,
                                                            const FlagSet& flags, Job& job,
                                                            const parallel::ProcessGrid& grid,
                                                            runtime::EngineOptions options);

}  // namespace cpfill::launch
