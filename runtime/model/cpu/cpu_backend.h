// cpfill/runtime/model/cpu/cpu_backend.h — the model backend on the CPU: fp32 everywhere, OpenBLAS
// GEMMs (layers.h), MPI communicators, the CPU attention kernel inside the ring, and the KV
// cache in host memory. What CI runs and what the CUDA backend is checked against.
//
//   CPFILL_ASSIGN_OR_RETURN(auto backend,
//                           MakeCpuBackend(config, std::move(weights), *grid.tp, *grid.cp, 8));
//   CPFILL_ASSIGN_OR_RETURN(auto model,
//                           LlamaModel::Create(config, std::move(backend), *grid.world, options));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/model_backend.h"
#include "runtime/model/model_config.h"
#include "runtime/model/weights.h"

namespace cpfill::runtime::cpu {

// `weights` is this rank's TP slice; `threads` the kernel threads of this rank (0: every core);
// `batch_invariant`: GEMMs one row at a time (StepOptions::batch_invariant).
absl::StatusOr<std::unique_ptr<ModelBackend>> MakeCpuBackend(
    const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
    parallel::Communicator& cp, int threads, bool batch_invariant = false);

// The whole CPU model in one call: the backend above (options.threads) and LlamaModel::Create.
absl::StatusOr<std::unique_ptr<LlamaModel>> CreateCpuModel(
    const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
    parallel::Communicator& cp, parallel::Communicator& world, const StepOptions& options);

}  // namespace cpfill::runtime::cpu
