#include "parallel/cuda/staged_attention.h"

#include <cstring>

#include "base/bfloat16.h"
#include "base/status.h"

#if CPFILL_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "attention/cuda/attention_cuda.h"
#endif

namespace cpfill::parallel {
#if !CPFILL_HAVE_CUDA

bool CudaBackendAvailable() { return false; }

absl::StatusOr<std::unique_ptr<CudaStagedAttention>> CudaStagedAttention::Create(int) {
  return absl::FailedPreconditionError(
      "this cpfill was built without the CUDA backend (configure with -DCPFILL_CUDA=ON on a "
      "machine with nvcc)");
}
CudaStagedAttention::~CudaStagedAttention() = default;
absl::Status CudaStagedAttention::Attend(const attention::AttentionParams&) {
  return absl::FailedPreconditionError("no CUDA backend");
}
absl::Status CudaStagedAttention::Reserve(int, size_t) {
  return absl::FailedPreconditionError("no CUDA backend");
}

#else

bool CudaBackendAvailable() { return attention::cuda::DeviceCount() > 0; }

absl::StatusOr<std::unique_ptr<CudaStagedAttention>> CudaStagedAttention::Create(int local_rank) {
  const int devices = attention::cuda::DeviceCount();
  if (devices == 0) {
    return absl::FailedPreconditionError("--backend cuda: no CUDA device is visible to this rank");
  }
  const int device = local_rank % devices;
  CPFILL_CUDA_CHECK(cudaSetDevice(device));
  std::unique_ptr<CudaStagedAttention> k(new CudaStagedAttention(device));
  cudaStream_t stream;
  CPFILL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  k->stream_ = stream;
  return k;
}

CudaStagedAttention::~CudaStagedAttention() {
  for (void* b : buffers_) cudaFree(b);
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status CudaStagedAttention::Reserve(int slot, size_t bytes) {
  if (slot >= static_cast<int>(buffers_.size())) {
    buffers_.resize(slot + 1, nullptr);
    capacity_.resize(slot + 1, 0);
  }
  if (capacity_[slot] >= bytes) return absl::OkStatus();
  cudaFree(buffers_[slot]);
  buffers_[slot] = nullptr;
  capacity_[slot] = 0;
  CPFILL_CUDA_CHECK(cudaMalloc(&buffers_[slot], bytes == 0 ? 16 : bytes));
  capacity_[slot] = bytes;
  return absl::OkStatus();
}

absl::Status CudaStagedAttention::Attend(const attention::AttentionParams& p) {
  CPFILL_RETURN_IF_ERROR(attention::ValidateAttentionParams(p));
  CPFILL_CUDA_CHECK(cudaSetDevice(device_));
  auto stream = static_cast<cudaStream_t>(stream_);
  const auto& sh = p.shape;
  const size_t nq = p.q_tokens * sh.num_heads * sh.head_dim;
  const size_t nkv = p.kv_tokens * sh.num_kv_heads * sh.head_dim;
  enum Slot { kQ, kK, kV, kQPos, kKPos, kO, kLse, kWorkspace };
  // Stage: fp32 -> bf16 on the host, then one copy per tensor.
  auto stage = [&](Slot slot, const float* src, size_t n) -> absl::Status {
    CPFILL_RETURN_IF_ERROR(Reserve(slot, n * 2));
    staging_.resize(n);
    for (size_t i = 0; i < n; ++i) staging_[i] = FloatToBfloat16Bits(src[i]);
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(buffers_[slot], staging_.data(), n * 2, cudaMemcpyHostToDevice, stream));
    // The staging vector is reused for the next tensor: wait for this copy.
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  };
  CPFILL_RETURN_IF_ERROR(stage(kQ, p.q, nq));
  CPFILL_RETURN_IF_ERROR(stage(kK, p.k, nkv));
  CPFILL_RETURN_IF_ERROR(stage(kV, p.v, nkv));
  CPFILL_RETURN_IF_ERROR(Reserve(kQPos, p.q_tokens * 4));
  CPFILL_RETURN_IF_ERROR(Reserve(kKPos, p.kv_tokens * 4));
  CPFILL_CUDA_CHECK(
      cudaMemcpyAsync(buffers_[kQPos], p.q_pos, p.q_tokens * 4, cudaMemcpyHostToDevice, stream));
  CPFILL_CUDA_CHECK(
      cudaMemcpyAsync(buffers_[kKPos], p.k_pos, p.kv_tokens * 4, cudaMemcpyHostToDevice, stream));
  CPFILL_RETURN_IF_ERROR(Reserve(kO, nq * 4));
  CPFILL_RETURN_IF_ERROR(Reserve(kLse, p.q_tokens * sh.num_heads * 4));
  attention::cuda::CudaAttentionArgs a{.shape = sh,
                                       .q = static_cast<const __nv_bfloat16*>(buffers_[kQ]),
                                       .q_pos = static_cast<const int32_t*>(buffers_[kQPos]),
                                       .q_tokens = p.q_tokens,
                                       .k = static_cast<const __nv_bfloat16*>(buffers_[kK]),
                                       .v = static_cast<const __nv_bfloat16*>(buffers_[kV]),
                                       .k_pos = static_cast<const int32_t*>(buffers_[kKPos]),
                                       .kv_tokens = p.kv_tokens,
                                       .slices = p.slices,
                                       .num_slices = p.num_slices,
                                       .output = attention::cuda::OutputMode::kFloat32,
                                       .o = buffers_[kO],
                                       .lse = static_cast<float*>(buffers_[kLse])};
  const size_t ws = attention::cuda::AttentionWorkspaceBytes(a);
  CPFILL_RETURN_IF_ERROR(Reserve(kWorkspace, ws));
  CPFILL_RETURN_IF_ERROR(
      attention::cuda::PartialAttentionCuda(a, buffers_[kWorkspace], ws, stream));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(p.o, buffers_[kO], nq * 4, cudaMemcpyDeviceToHost, stream));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(p.lse, buffers_[kLse], p.q_tokens * sh.num_heads * 4,
                                    cudaMemcpyDeviceToHost, stream));
  CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

#endif  // CPFILL_HAVE_CUDA

}  // namespace cpfill::parallel
