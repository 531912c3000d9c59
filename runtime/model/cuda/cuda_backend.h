// cpfill/runtime/model/cuda/cuda_backend.h — the model backend on a GPU: bf16 weights, GEMM
// operands and KV cache with fp32 accumulation, an fp32 residual stream, cuBLASLt GEMMs, the layer
// kernels of layer_kernels.h, the device ring over NCCL for attention, NCCL all-reduces in the TP
// group. Every operation is enqueued on the grid's compute stream; phases are timed with CUDA
// events.
//
//   CPFILL_ASSIGN_OR_RETURN(parallel::NcclGrid nccl, parallel::CreateNcclGrid(grid, options));
//   CPFILL_ASSIGN_OR_RETURN(auto backend, MakeCudaBackend(config, weights, nccl));
//   weights = ModelWeights{};  // uploaded: the host copy may go
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "parallel/cuda/nccl_communicator.h"
#include "runtime/model/model_backend.h"
#include "runtime/model/model_config.h"
#include "runtime/model/weights.h"

namespace cpfill::runtime::cuda {

// `weights`: this rank's TP slice (host fp32), uploaded in bf16. `nccl` (the GPU, its compute
// stream, the TP and CP communicators) must outlive the backend.
absl::StatusOr<std::unique_ptr<ModelBackend>> MakeCudaBackend(const ModelConfig& config,
                                                              const ModelWeights& weights,
                                                              parallel::NcclGrid& nccl);

}  // namespace cpfill::runtime::cuda
