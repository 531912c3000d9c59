// cpfill/parallel/cuda/device_ring_attention.h — the ring algorithms on GPUs: device memory,
// the CUDA attention kernel, NCCL.
//
// The same algorithms as ring_attention.h, over the same RingPlan (message layouts, step slices,
// skipped chunk pairs), with bf16 messages:
//   pass-KV     the exchange of step j+1 is enqueued on the communication stream before step j's
//               kernel, which folds its result straight into the running fp32 (O, LSE) (the
//               kernel's merge mode: no separate merge pass);
//   pass-Q      partial outputs in fp32 go home by an NCCL all-to-all; the merge kernel combines
//               them;
//   all-gather  NCCL all-gather, then one kernel call per batch.
// Inside the loop nothing allocates and nothing waits on the host; Run() ends with the
// communicator's Synchronize(), which has a deadline.
//
//   CPFILL_ASSIGN_OR_RETURN(auto ring, DeviceRingAttention::Create(*nccl.cp, plan, shape));
//   CPFILL_RETURN_IF_ERROR(ring->Run(RingAlgorithm::kPassKV, d_q, d_k, d_v, d_o, d_lse, &t));
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "attention/cuda/attention_cuda.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/ring_plan.h"

namespace cpfill::parallel {

// An owned device allocation that grows on demand and never shrinks.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), capacity_(o.capacity_) {
    o.data_ = nullptr;
    o.capacity_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }
  absl::Status Reserve(size_t bytes);
  template <typename T>
  T* As(size_t offset_bytes = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset_bytes);
  }
  size_t capacity() const { return capacity_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// The ring's device memory and timing events, kept by a caller that runs many batches (the
// model, once per layer and per prefill) so that a new plan allocates nothing: cudaMalloc and
// cudaFree of the message and workspace buffers cost milliseconds and synchronize the device.
struct DeviceRingScratch {
  DeviceRingScratch() = default;
  ~DeviceRingScratch();
  DeviceRingScratch(const DeviceRingScratch&) = delete;
  DeviceRingScratch& operator=(const DeviceRingScratch&) = delete;

  DeviceBuffer q_pos, kv_pos;  // the plan's positions
  DeviceBuffer msg[2], partials, received, merged, gathered, gathered_kv, workspace;
  std::vector<cudaEvent_t> events;  // created on first use
  size_t next_event = 0;
};

class DeviceRingAttention {
 public:
  // `cp` is the CP ring of the plan; work runs on cp's compute stream. `scratch`, when given,
  // outlives the ring and is reused by the next one; without it the ring owns its own.
  static absl::StatusOr<std::unique_ptr<DeviceRingAttention>> Create(
      NcclCommunicator& cp, const sharding::ShardPlan& plan, const attention::AttentionShape& shape,
      cudaStream_t stream, DeviceRingScratch* scratch = nullptr);

  // Device tensors in the rank's local layout: q [q_rows, H, D] bf16, k/v [kv_rows, H_kv, D]
  // bf16 -> o [q_rows, H, D] fp32, lse [q_rows, H] fp32. Returns after the host synchronized.
  absl::Status Run(RingAlgorithm algorithm, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, float* o, float* lse, RingTimings* timings);

  const sharding::LocalLayout& layout() const { return ring_plan_.layout(); }

 private:
  DeviceRingAttention(NcclCommunicator& cp, const sharding::ShardPlan& plan,
                      const attention::AttentionShape& shape, cudaStream_t stream,
                      DeviceRingScratch* scratch);
  absl::Status Init();

  absl::Status RunPassKV(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         float* o, float* lse, RingTimings* t);
  absl::Status RunPassQ(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                        float* o, float* lse, RingTimings* t);
  absl::Status RunAllGather(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                            float* o, float* lse, RingTimings* t);

  MessageLayout KvMessage() const;
  MessageLayout QMessage() const;
  absl::Status PackKv(const __nv_bfloat16* k, const __nv_bfloat16* v, const DeviceBuffer& msg);
  absl::Status PackQ(const __nv_bfloat16* q, const DeviceBuffer& msg);
  // Enqueues the attention kernel, growing the workspace first if it is too small.
  absl::Status Attend(const attention::cuda::CudaAttentionArgs& args);
  void FillStepTimes(const std::vector<std::unique_ptr<PendingExchange>>& exchanges,
                     const std::vector<cudaEvent_t>& c0, const std::vector<cudaEvent_t>& c1,
                     RingTimings* t) const;
  cudaEvent_t Mark();  // records the next event on the stream
  double Seconds(cudaEvent_t a, cudaEvent_t b) const;

  NcclCommunicator& cp_;
  RingPlan ring_plan_;
  attention::AttentionShape shape_;
  cudaStream_t stream_;
  std::unique_ptr<DeviceRingScratch> own_scratch_;  // when the caller gave none
  DeviceRingScratch& s_;
};

}  // namespace cpfill::parallel
