// cpfill/launch/engine_host.h — the engine and what it stands on, built from flags on every rank:
// the model (a preset or a checkpoint, cut to --layers), its weights, the backend and the KV
// cache. `cpfill serve` puts an HTTP front on it; the C API (launch/embed/) hands it to a program.
//
//   EngineFlags ef;  AddEngineFlags(flags, &ef);   ...parse...
//   CPFILL_ASSIGN_OR_RETURN(auto host, BuildEngineHost(ef, flags, session, grid, {}));
//   std::thread loop([&] { host->engine->Run(); });
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launch/flags.h"
#include "launch/model_setup.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "runtime/engine.h"
#include "runtime/model_config.h"
#include "runtime/tokenizer.h"

namespace cpfill::launch {

struct EngineFlags {
  std::string model, backend = "auto";
  int layers = 0;
  int64_t seed = 1;
  int64_t max_batch_tokens = 131072;
  int max_queue = 1024;
  int max_running = 256;
  int64_t kv_capacity_tokens = 0;
  double kv_memory_fraction = 0;
  int kv_block_tokens = 64;
  bool no_prefix_cache = false;
  bool no_prefix_batching = false;
  bool batch_invariant = false;
  SelectorFlags selector;
};

// The engine's flags: --model, --backend, --layers, --seed, the batch and queue bounds, the KV
// cache's size, and the selector's.
void AddEngineFlags(FlagSet& flags, EngineFlags* engine_flags);

// Members end in reverse order: the engine before the model it runs.
struct EngineHost {
  std::string backend;  // resolved: cpu or cuda
  runtime::ModelConfig config;
  LoadedModel loaded;
  std::unique_ptr<runtime::Engine> engine;
  // A checkpoint's tokenizer.json (and tokenizer_config.json); none for presets and checkpoints
  // without one (they take token ids only).
  std::optional<runtime::Tokenizer> tokenizer;
};

// Collective. `options` brings what the caller adds (on_batch); the bounds come from the flags
// and the heartbeat from the session's deadline. Bad input fails alike on every rank
// (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted), also a checkpoint that only
// some ranks cannot read (LoadWeightsAgreed) and a malformed tokenizer.json.
absl::StatusOr<std::unique_ptr<EngineHost>> BuildEngineHost(const EngineFlags& engine_flags,
                                                            const FlagSet& flags, Session& session,
                                                            const parallel::ProcessGrid& grid,
                                                            runtime::EngineOptions options);

}  // namespace cpfill::launch
