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
#include <tuple>
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
  // Activations of one prefill, kept between prefills and grown to the largest batch seen: a
  // fresh cudaMalloc/cudaFree of several GB per prefill cost milliseconds of TTFT (10 ms at 32K
  // tokens on an H200) and synchronized the device.
  struct Workspace {
    parallel::DeviceBuffer ids, qpos, x, h, q, kn, vn, k_all, v_all, attn, lse, attn16, proj, gate,
        up, last, normed, logits;
    parallel::DeviceRingScratch ring;
  };
  // Times the phases of a prefill with CUDA events on the compute stream, so phases need no host
  // synchronization of their own; Collect() adds each phase's GPU time once the stream is idle.
  class PhaseEvents {
   public:
    ~PhaseEvents();
    absl::Status Begin(cudaStream_t stream);
    absl::Status End(cudaStream_t stream, double* seconds);
    void Collect();
    void Reset();  // forgets the phases of a prefill that failed half-way

   private:
    absl::StatusOr<cudaEvent_t> Next();
    std::vector<cudaEvent_t> pool_;
    size_t used_ = 0;
    cudaEvent_t open_ = nullptr;
    std::vector<std::tuple<double*, cudaEvent_t, cudaEvent_t>> pending_;
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
  Workspace work_;
  PhaseEvents phases_;
};

}  // namespace cpfill::runtime::cuda
