// cpfill/runtime/cuda/llama_model_cuda.h — whole-model prefill on GPUs: the same model and the
// same batch logic (prefill_batch.h) as the CPU model, with bf16 weights and activations (the
// residual stream in fp32), cuBLASLt GEMMs, the layer kernels of layer_kernels.h, the device
// ring over NCCL for attention, NCCL all-reduces inside the TP group, and a KV cache on the GPU.
//
//   CPFILL_ASSIGN_OR_RETURN(auto model, LlamaModelCuda::Create(config, weights, nccl,
//                                                              *grid.world, options));
//   CPFILL_ASSIGN_OR_RETURN(auto out, model->Prefill(batch, &timings, nullptr));
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/cuda/device_ring_attention.h"
#include "parallel/cuda/nccl_communicator.h"
#include "runtime/cuda/gemm.h"
#include "runtime/llama_model.h"
#include "runtime/prefill_batch.h"

namespace cpfill::runtime::cuda {

class LlamaModelCuda : public PrefillModel {
 public:
  // `weights`: this rank's TP slice (host fp32), uploaded in bf16. `nccl` provides the GPU, the
  // compute stream and the TP and CP communicators; `world` (MPI) agrees on capacity and
  // collects logits.
  static absl::StatusOr<std::unique_ptr<LlamaModelCuda>> Create(const ModelConfig& config,
                                                                const ModelWeights& weights,
                                                                parallel::NcclGrid& nccl,
                                                                parallel::Communicator& world,
                                                                PrefillOptions options);

  absl::StatusOr<std::vector<SequenceOutput>> Prefill(
      const std::vector<PrefillRequest>& batch, PrefillTimings* timings,
      const std::function<void(int)>& progress) override;
  int64_t kv_tokens_held() const override;

 private:
  struct LayerDevice {
    parallel::DeviceBuffer input_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down;
  };
  struct Session {
    SessionLayout where;
    std::vector<std::unique_ptr<parallel::DeviceBuffer>> k, v;  // [layer]: this rank's rows
    std::vector<int64_t> rows;                                  // [layer] rows held
  };
  LlamaModelCuda(const ModelConfig& config, parallel::NcclGrid& nccl, parallel::Communicator& world,
                 PrefillOptions options)
      : config_(config), nccl_(nccl), world_(world), options_(options) {}
  absl::Status Upload(parallel::DeviceBuffer& dst, const std::vector<float>& host);

  ModelConfig config_;
  parallel::NcclGrid& nccl_;
  parallel::Communicator& world_;
  PrefillOptions options_;
  Gemm gemm_;
  std::vector<LayerDevice> layers_;
  parallel::DeviceBuffer embedding_, final_norm_, lm_head_, inv_freq_;
  std::map<std::string, Session> sessions_;
};

}  // namespace cpfill::runtime::cuda
