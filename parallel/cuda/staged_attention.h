// cpfill/parallel/cuda/staged_attention.h — the CUDA attention kernel on host tensors, for the
// host ring ("cuda-staged").
//
// The host ring (CpuRingOps over MPI) keeps its messages in host memory; this lets it run the
// CUDA kernel (attention/cuda/) for every partial attention: inputs are rounded to bf16 and
// staged to the device, O and LSE come back in fp32, merges run on the host. That is what
// `cpfill attention --backend cuda-staged` uses, and what checks the GPU kernel inside the real
// MPI ring on any host with a GPU per rank. The device ring (CudaRingOps on NCCL, no staging) is
// the one for performance.
//
//   CPFILL_ASSIGN_OR_RETURN(auto staged, CudaStagedAttention::Create(local_rank));
//   CpuRingOps ops(&pool, [s = staged.get()](const auto& p) { return s->Attend(p); });
//   CPFILL_ASSIGN_OR_RETURN(auto ring, RingAttention::Create(*grid.cp, plan, shape, &ops));
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"

namespace cpfill::parallel {

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaBackendAvailable();

class CudaStagedAttention {
 public:
  // Uses device `local_rank % device count`. FailedPrecondition without the CUDA backend or a
  // device.
  static absl::StatusOr<std::unique_ptr<CudaStagedAttention>> Create(int local_rank);
  ~CudaStagedAttention();
  CudaStagedAttention(const CudaStagedAttention&) = delete;
  CudaStagedAttention& operator=(const CudaStagedAttention&) = delete;

  // attention.h's contract on host fp32 tensors; returns when O and LSE are back on the host.
  absl::Status Attend(const attention::AttentionParams& p);
  int device() const { return device_; }

 private:
  explicit CudaStagedAttention(int device) : device_(device) {}
  // Grows a device buffer to at least `bytes` (no shrinking: the ring reuses shapes).
  absl::Status Reserve(int slot, size_t bytes);

  int device_;
  void* stream_ = nullptr;      // cudaStream_t
  std::vector<void*> buffers_;  // device buffers by slot
  std::vector<size_t> capacity_;
  std::vector<uint16_t> staging_;  // host bf16 staging
};

}  // namespace cpfill::parallel
