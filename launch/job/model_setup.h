// cpfill/launch/job/model_setup.h — what a command (and, later, the engine) needs to hold a model:
// its prompts, its weights read by every rank with one verdict, the backend it runs on, and the
// model itself with its KV cache.
//
//   CPFILL_ASSIGN_OR_RETURN(auto weights, LoadWeightsAgreed(config, "llama3-8b", 1, grid));
//   CPFILL_ASSIGN_OR_RETURN(LoadedModel m, BuildModel(config, std::move(weights), "cuda", grid,
//                                                     comm_options, options));
//   CPFILL_ASSIGN_OR_RETURN(auto out, m.model->Prefill(batch, &timings, nullptr));
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/grid.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/model_config.h"
#include "runtime/model/prefill_batch.h"
#include "runtime/model/weights.h"

namespace cpfill::launch {

// Synthetic prompts of these lengths: token ids from the seed, the same on every rank.
std::vector<runtime::PrefillRequest> SyntheticPrompts(const std::vector<int64_t>& lens, int vocab,
                                                      uint64_t seed);
// A JSON list of lists of token ids. InvalidArgument naming the file and the sequence.
absl::StatusOr<std::vector<runtime::PrefillRequest>> ReadTokensFile(const std::string& path);

// This TP rank's weights: synthetic for a preset (from `seed`), else the checkpoint's slice.
absl::StatusOr<runtime::ModelWeights> MakeWeights(const runtime::ModelConfig& config,
                                                  const std::string& model, uint64_t seed,
                                                  int tp_rank, int tp_size);

// ResourceExhausted, with the bytes needed and free, when one TP slice of the weights (fp32)
// does not fit in this rank's share of the host's memory.
absl::Status WeightsFit(const runtime::ModelConfig& config, int tp_size);

// WeightsFit and MakeWeights on every rank, one verdict: each rank reads only its own slice, so a
// bad file may show on some ranks only. Every rank returns the lowest failing world rank's error
// (naming it, and how many ranks failed), so rank 0 can print it once.
absl::StatusOr<runtime::ModelWeights> LoadWeightsAgreed(const runtime::ModelConfig& config,
                                                        const std::string& model, uint64_t seed,
                                                        const parallel::ProcessGrid& grid);

// A model on its backend. `device` keeps the CUDA backend's NCCL grid alive (type-erased so
// that CPU-only builds need no NCCL header); it outlives `model`.
struct LoadedModel {
  std::shared_ptr<void> device;
  std::unique_ptr<runtime::LlamaModel> model;
  LoadedModel();
  LoadedModel(LoadedModel&&) noexcept;
  LoadedModel& operator=(LoadedModel&&) noexcept;
  ~LoadedModel();
};

// `backend`: "cpu" or "cuda" (resolved already). The CUDA backend uploads the weights and frees
// the host copy.
absl::StatusOr<LoadedModel> BuildModel(const runtime::ModelConfig& config,
                                       runtime::ModelWeights weights, const std::string& backend,
                                       const parallel::ProcessGrid& grid,
                                       parallel::CommOptions comm_options,
                                       const runtime::StepOptions& options);

}  // namespace cpfill::launch
