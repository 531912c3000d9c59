// cpfill/parallel/cuda/staged_attention_kernels.h — the ring's AttentionKernels on a CUDA device.
//
// The ring code of ring_attention.h keeps its messages in host memory; this backend lets it run
// the CUDA kernel (attention/cuda/) for every partial attention: inputs are rounded to bf16 and
// staged to the device, O and LSE come back in fp32, merges run on the host. That is what
// `cpfill attention --backend cuda` uses today, and what checks the GPU kernel inside the real
// ring on any host with a GPU per rank. The device-resident ring (NCCL, no staging) replaces it
// for performance.
//
//   CPFILL_ASSIGN_OR_RETURN(auto kernels, CudaStagedAttentionKernels::Create(local_rank, &pool));
//   CPFILL_ASSIGN_OR_RETURN(auto ring, RingAttention::Create(*grid.cp, plan, shape,
//   kernels.get()));
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/ring_attention.h"

namespace cpfill::parallel {

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaBackendAvailable();

class CudaStagedAttentionKernels : public AttentionKernels {
 public:
  // Uses device `local_rank % device count`. FailedPrecondition without the CUDA backend or a
  // device.
  static absl::StatusOr<std::unique_ptr<CudaStagedAttentionKernels>> Create(int local_rank,
                                                                            ThreadPool* pool);
  ~CudaStagedAttentionKernels() override;

  absl::Status Attend(const attention::AttentionParams& p) override;
  absl::Status MergeInto(const attention::AttentionShape& shape, int64_t rows, float* o_acc,
                         float* lse_acc, const float* o, const float* lse) override;
  absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                     std::span<const attention::PartialView> parts, float* o, float* lse) override;
  int device() const { return device_; }

 private:
  CudaStagedAttentionKernels(int device, ThreadPool* pool) : device_(device), pool_(pool) {}
  // Grows a device buffer to at least `bytes` (no shrinking: the ring reuses shapes).
  absl::Status Reserve(int slot, size_t bytes);

  int device_;
  ThreadPool* pool_;
  void* stream_ = nullptr;      // cudaStream_t
  std::vector<void*> buffers_;  // device buffers by slot
  std::vector<size_t> capacity_;
  std::vector<uint16_t> staging_;  // host bf16 staging
};

}  // namespace cpfill::parallel
