// cpfill/parallel/cuda/cuda_ring_ops.h — the ring's backend on a GPU: device memory, bf16
// messages, the CUDA attention kernel, CUDA events for timing; with an NcclCommunicator as the
// ring's Communicator, RingAttention (ring_attention.h) runs entirely on the device:
//   pass-KV     the exchange of step j+1 is enqueued on the communication stream before step j's
//               kernel, which folds its result straight into the running fp32 (O, LSE) (the
//               kernel's kMergeIntoFloat32 mode: no separate merge pass);
//   pass-Q      partial outputs in fp32 go home by an NCCL all-to-all; the merge kernel combines
//               them (hence CP <= kMaxMergeParts);
//   all-gather  NCCL all-gather, then one kernel call per batch.
// Every call is enqueued on the compute stream; the host waits once per run, in Finish()
// (NcclCommunicator::Synchronize, with its deadline). Buffers, the kernel's workspace and the
// events belong to the ops and are kept between runs and between rings: keep one CudaRingOps
// for the life of a model and create a RingAttention per prefill over it; after the first
// prefill of the largest size nothing is cudaMalloc'ed.
//
//   CPFILL_ASSIGN_OR_RETURN(auto ops, CudaRingOps::Create(*nccl.cp, nccl.compute.get()));
//   CPFILL_ASSIGN_OR_RETURN(auto ring, RingAttention::Create(*nccl.cp, plan, shape, ops.get()));
//   CPFILL_RETURN_IF_ERROR(ring->Run(RingAlgorithm::kPassKV, d_q, d_k, d_v, d_o, d_lse, &t));
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/cuda/attention_cuda.h"
#include "parallel/cuda/device_buffer.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/ring_attention.h"

namespace cpfill::parallel {

class CudaRingOps : public RingOps {
 public:
  // Work runs on `stream`, the compute stream `cp` orders its operations against; Finish() is
  // cp.Synchronize(). `cp` outlives the ops.
  static absl::StatusOr<std::unique_ptr<CudaRingOps>> Create(NcclCommunicator& cp,
                                                             cudaStream_t stream);
  ~CudaRingOps() override;
  CudaRingOps(const CudaRingOps&) = delete;
  CudaRingOps& operator=(const CudaRingOps&) = delete;

  size_t elem_bytes() const override { return 2; }  // bf16
  // Each level of a prefix-batched step is a launch and an fp32 merge (CPFILL_PREFIX_TREE=always:
  // none counted).
  attention::TreeCosts tree_costs() const override;
  // Where the Hopper kernel reads the blocks in place (ReadsPagedPrefillInPlace), a step does
  // when asked (PagedKv::prefill_in_place) or always under CPFILL_PAGED_PREFILL=in-place; never
  // under =gather. Otherwise GathersPagedPrefill is true (the gathered rows' memory is counted),
  // and a step still reads in place where its gather would cost more than the in-place kernel's
  // slower loads (attention::cuda::InPlaceBeatsGather: short prefills after long cached keys).
  bool GathersPagedPrefill(const attention::AttentionShape& shape,
                           const attention::PagedKv& paged) const override;
  bool CanReadPagedPrefillInPlace(const attention::AttentionShape& shape,
                                  const attention::PagedKv& paged) const override;
  // attention::cuda::StepRuleOnGpu, against the flat step read in place where this ops would
  // read it so (GathersPagedPrefill, else attention::cuda::FlatStepReadsInPlace); a fresh decode
  // step's wide roots are gathered (attention::cuda::WideRootRuleOf).
  attention::SharedBlockRule StepRule(const attention::AttentionShape& shape,
                                      std::span<const attention::SequenceSlice> slices,
                                      const attention::PagedKv& paged) const override;
  // Head dims with a kernel; CP at most kMaxMergeParts (the pass-Q merge takes all parts at once).
  absl::Status CheckShape(const attention::AttentionShape& shape, int cp_size) const override;
  // The key positions' runs are uploaded and expanded on the device (ExpandPositionRuns).
  absl::Status SetPositions(int slot, std::span<const int32_t> q_pos,
                            std::span<const sharding::PositionRun> kv_runs) override;
  const int32_t* q_positions(int slot) const override { return q_pos_[slot].As<int32_t>(); }
  const int32_t* kv_positions(int slot) const override { return kv_pos_[slot].As<int32_t>(); }
  absl::StatusOr<void*> Buffer(int slot, size_t bytes) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes) override;
  absl::Status Fill(void* dst, uint8_t byte, size_t bytes) override;
  // The kernel, growing its workspace first if too small (the first run of a larger plan).
  // Paged K/V whose sequences share leading blocks: two launches, the roots (and the slices
  // under none) then the members' own rows merged in (prefix_batched_cuda.h). A prefill step
  // over paged K/V (attention::GathersPagedKv) gathers its rows first, the shared ones once.
  absl::Status Attend(const RingStepArgs& args) override;
  absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                     std::span<const attention::PartialView> parts, float* o, float* lse) override;
  absl::Status BeginRun(int max_marks) override;
  int Mark() override;  // records the next event on the stream
  double Seconds(int a, int b) const override;
  // Waits for the run (CP deadline); then the device buffers retired by growths can go.
  absl::Status Finish() override;
  void PushRange(const char* name) override;  // NVTX
  void PopRange() override;

  cudaStream_t stream() const { return stream_; }

 private:
  CudaRingOps(NcclCommunicator& cp, cudaStream_t stream) : cp_(cp), stream_(stream) {}
  // One kernel call over args.slices, its workspace grown first.
  absl::Status Launch(const attention::cuda::CudaAttentionArgs& args);
  // A gathered paged step: its roots and rows planned on the host, then gathered and run.
  absl::Status AttendGathered(const RingStepArgs& a,
                              const attention::cuda::CudaAttentionArgs& args);

  NcclCommunicator& cp_;
  cudaStream_t stream_;
  std::array<DeviceBuffer, kPositionSlots> q_pos_, kv_pos_;  // the plans' positions, by slot
  std::array<DeviceBuffer, kPositionSlots> kv_runs_;         // their key runs, as uploaded
  std::vector<DeviceBuffer> buffers_;  // scratch by slot
  DeviceBuffer workspace_;             // the attention kernel's
  // Gathered steps' copies in device memory, one slot per plan of the table generation in use:
  // uploaded at a forward's first layer, read by every later one. A new generation starts once
  // the last forward has finished, so its slots are free again.
  struct UploadedCopies {
    uint64_t plan_id = 0;
    DeviceBuffer copies;
  };
  static constexpr size_t kMaxUploadedPlans = 32;
  std::vector<UploadedCopies> uploaded_copies_;
  uint64_t uploaded_generation_ = 0;
  absl::StatusOr<const attention::PagedGather::Copy*> DeviceCopies(
      const PagedStepPlan& plan, const std::vector<attention::PagedGather::Copy>& copies);
  std::vector<cudaEvent_t> events_;    // created in BeginRun, reused by every run
  int next_mark_ = 0;
};

}  // namespace cpfill::parallel
