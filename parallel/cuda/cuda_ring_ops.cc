#include "parallel/cuda/cuda_ring_ops.h"

#include <nvtx3/nvToolsExt.h>

#include <algorithm>

#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/prefix_batched_cuda.h"
#include "base/knobs.h"
#include "base/status.h"
#include "parallel/cuda/position_runs.h"

namespace cpfill::parallel {
namespace {

using attention::cuda::CudaAttentionArgs;
using attention::cuda::kMaxMergeParts;
using attention::cuda::OutputMode;
using Bf16 = __nv_bfloat16;

// Smallest allocation: keeps pointers of empty buffers valid and 16-byte aligned.
constexpr size_t kMinBytes = 256;

}  // namespace

absl::StatusOr<std::unique_ptr<CudaRingOps>> CudaRingOps::Create(NcclCommunicator& cp,
                                                                 cudaStream_t stream) {
  std::unique_ptr<CudaRingOps> ops(new CudaRingOps(cp, stream));
  CPFILL_RETURN_IF_ERROR(ops->BeginRun(64));  // the events most runs need, made once
  return ops;
}

CudaRingOps::~CudaRingOps() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

absl::Status CudaRingOps::CheckShape(const attention::AttentionShape& shape, int cp_size) const {
  CPFILL_CHECK_ARG(attention::cuda::SupportedHeadDim(shape.head_dim), "head_dim ", shape.head_dim,
                   " has no CUDA kernel (64, 128)");
  CPFILL_CHECK_ARG(cp_size <= kMaxMergeParts, "pass-Q merges at most ", kMaxMergeParts,
                   " partials: CP", cp_size, " is too large");
  return absl::OkStatus();
}

absl::Status CudaRingOps::SetPositions(int slot, std::span<const int32_t> q_pos,
                                       std::span<const sharding::PositionRun> kv_runs) {
  // The key runs as (first row, first position) pairs, expanded on the device.
  std::vector<int32_t> runs;
  runs.reserve(2 * kv_runs.size());
  int64_t rows = 0;
  for (const sharding::PositionRun& run : kv_runs) {
    runs.push_back(static_cast<int32_t>(rows));
    runs.push_back(static_cast<int32_t>(run.begin));
    rows += run.length;
  }
  CPFILL_CHECK_ARG(rows < (int64_t{1} << 31), "ring attention: ", rows,
                   " key rows on one rank exceed 2^31");
  DeviceBuffer& q = q_pos_[slot];
  DeviceBuffer& kv = kv_pos_[slot];
  DeviceBuffer& kv_runs_dev = kv_runs_[slot];
  const size_t runs_bytes = runs.size() * sizeof(int32_t);
  CPFILL_RETURN_IF_ERROR(q.Reserve(std::max(kMinBytes, q_pos.size_bytes())));
  CPFILL_RETURN_IF_ERROR(kv.Reserve(std::max<size_t>(kMinBytes, rows * sizeof(int32_t))));
  CPFILL_RETURN_IF_ERROR(kv_runs_dev.Reserve(std::max(kMinBytes, runs_bytes)));
  // From pageable memory: each copy returns once the bytes are staged, so the host spans may go
  // (as ModelBackend::Upload); stream-ordered after the kernels that read the slot before.
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(q.As<void>(), q_pos.data(), q_pos.size_bytes(),
                                    cudaMemcpyHostToDevice, stream_));
  if (rows == 0) return absl::OkStatus();
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(kv_runs_dev.As<void>(), runs.data(), runs_bytes,
                                    cudaMemcpyHostToDevice, stream_));
  CPFILL_CUDA_CHECK(cuda::ExpandPositionRuns(kv_runs_dev.As<int32_t>(),
                                             static_cast<int>(kv_runs.size()), kv.As<int32_t>(),
                                             rows, stream_));
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaRingOps::Buffer(int slot, size_t bytes) {
  if (slot >= static_cast<int>(buffers_.size())) buffers_.resize(slot + 1);
  CPFILL_RETURN_IF_ERROR(buffers_[slot].Reserve(std::max(kMinBytes, bytes)));
  return buffers_[slot].As<void>();
}

absl::Status CudaRingOps::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) {
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  return absl::OkStatus();
}

absl::Status CudaRingOps::Fill(void* dst, uint8_t byte, size_t bytes) {
  if (bytes > 0) CPFILL_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, stream_));
  return absl::OkStatus();
}

// The exchange's end event lets the SMs held back for it join the prefill kernel once it ends
// (exchange_done); a decode step (no slice longer than a decode step's queries) does without, as
// asking for the event waits for the exchange's enqueue, which otherwise overlaps this step's.
absl::Status CudaRingOps::Attend(const RingStepArgs& a) {
  const CudaAttentionArgs args{
      .shape = a.shape,
      .q = static_cast<const Bf16*>(a.q),
      .q_pos = a.q_pos,
      .q_tokens = a.q_tokens,
      .k = static_cast<const Bf16*>(a.k),
      .v = static_cast<const Bf16*>(a.v),
      .k_pos = a.k_pos,
      .kv_tokens = a.kv_tokens,
      .slices = a.slices.data(),
      .num_slices = static_cast<int64_t>(a.slices.size()),
      .output = a.fold_into_output ? OutputMode::kMergeIntoFloat32 : OutputMode::kFloat32,
      .o = a.o,
      .lse = a.lse,
      .communication_in_flight = a.communication_in_flight,
      .exchange_done = a.exchange != nullptr && attention::GathersPagedKv(a.slices)
                           ? static_cast<cudaEvent_t>(a.exchange->device_event())
                           : nullptr,
      .paged = a.paged_kv};
  if (a.paged_kv == nullptr) return Launch(args);
  if (attention::GathersPagedKv(a.slices)) return AttendGathered(a, args);
  const PagedStepPlan& step = PlanPagedStep(a, a.paged_kv->host_table, /*gather=*/false,
                                            attention::cuda::WideRootRuleOf(a.shape));
  const attention::SharedBlockTree& tree = step.tree;
  if (tree.counts.roots == 0) return Launch(args);
  prefix_batch_counts_ += tree.counts;
  // A fresh step's wide roots on the prefill kernel: read in place where asked and the Hopper
  // kernel can (attention::cuda::WideRootsInPlaceAsked), else over their gathered rows (a folded
  // step's stay in place: the gathered roots would overwrite the running result). Either takes
  // more workspace; where that is not free, the roots are read in place on the decode kernel
  // below: slower, the same result, and no step fails for the want of a speed-up.
  const bool fresh = args.output == OutputMode::kFloat32;
  if (fresh && attention::cuda::WideRootsInPlaceAsked(step.wide, cp_.size()) &&
      CanReadPagedPrefillInPlace(a.shape, *a.paged_kv) &&
      workspace_
          .Reserve(std::max(kMinBytes, attention::cuda::InPlacePagedWorkspaceBytes(args, tree)))
          .ok()) {
    return attention::cuda::InPlacePagedAttentionCuda(args, tree, workspace_.As<void>(),
                                                      workspace_.capacity(), stream_);
  }
  if (!step.wide.gathered.copies.empty() && fresh) {
    if (workspace_
            .Reserve(std::max(kMinBytes, attention::cuda::WideRootsWorkspaceBytes(args, step.wide)))
            .ok()) {
      CPFILL_ASSIGN_OR_RETURN(const attention::PagedGather::Copy* copies,
                              DeviceCopies(step, step.wide.gathered.copies));
      return attention::cuda::WideRootsAttentionCuda(args, step.wide, workspace_.As<void>(),
                                                     workspace_.capacity(), stream_, copies);
    }
  }
  CPFILL_RETURN_IF_ERROR(workspace_.Reserve(
      std::max(kMinBytes, attention::cuda::SharedBlocksWorkspaceBytes(args, tree))));
  return attention::cuda::SharedBlocksAttentionCuda(args, tree, workspace_.As<void>(),
                                                    workspace_.capacity(), stream_);
}

attention::SharedBlockRule CudaRingOps::StepRule(const attention::AttentionShape& shape,
                                                 std::span<const attention::SequenceSlice> slices,
                                                 const attention::PagedKv& paged) const {
  // As AttendGathered decides for a step without roots (without the host table no roots are
  // found: nothing to weigh).
  const bool flat_in_place = attention::GathersPagedKv(slices) && !paged.host_table.empty() &&
                             CanReadPagedPrefillInPlace(shape, paged) &&
                             (!GathersPagedPrefill(shape, paged) ||
                              attention::cuda::FlatStepReadsInPlace(shape, slices, paged));
  return attention::cuda::StepRuleOnGpu(slices, tree_costs(), flat_in_place);
}

bool CudaRingOps::CanReadPagedPrefillInPlace(const attention::AttentionShape& shape,
                                             const attention::PagedKv& paged) const {
  static const bool never = knobs::Choice(knobs::kPagedPrefill) == "gather";
  return !never && attention::cuda::ReadsPagedPrefillInPlace(shape, paged);
}

bool CudaRingOps::GathersPagedPrefill(const attention::AttentionShape& shape,
                                      const attention::PagedKv& paged) const {
  static const bool always = knobs::Choice(knobs::kPagedPrefill) == "in-place";
  return !((always || paged.prefill_in_place) && CanReadPagedPrefillInPlace(shape, paged));
}

attention::TreeCosts CudaRingOps::tree_costs() const {
  static const bool always = knobs::Choice(knobs::kPrefixTree) == "always";
  return always ? attention::TreeCosts{} : attention::kGpuTreeCosts;
}

absl::Status CudaRingOps::AttendGathered(const RingStepArgs& a, const CudaAttentionArgs& args) {
  const attention::PagedKv& paged = *a.paged_kv;
  CPFILL_CHECK_ARG(!paged.host_table.empty(),
                   "CUDA ring: a paged prefill step needs the block table in host memory");
  CPFILL_RETURN_IF_ERROR(paged.Validate(int64_t{a.shape.num_kv_heads} * a.shape.head_dim * 2,
                                        a.slices.data(), static_cast<int64_t>(a.slices.size())));
  // Read in place where asked and the Hopper kernel can: nothing is gathered. Else in place too
  // where the gather would cost more than the in-place kernel's slower loads (the gather plan's
  // tree is the one the in-place step runs).
  const bool asked = !GathersPagedPrefill(a.shape, paged);
  const PagedStepPlan& step = PlanPagedStep(a, paged.host_table, /*gather=*/!asked);
  const bool in_place =
      asked || (CanReadPagedPrefillInPlace(a.shape, paged) &&
                attention::cuda::InPlaceBeatsGather(a.shape, step.gather, a.slices));
  prefix_batch_counts_ += step.tree.counts;
  if (in_place) {
    CPFILL_RETURN_IF_ERROR(workspace_.Reserve(
        std::max(kMinBytes, attention::cuda::InPlacePagedWorkspaceBytes(args, step.tree))));
    return attention::cuda::InPlacePagedAttentionCuda(args, step.tree, workspace_.As<void>(),
                                                      workspace_.capacity(), stream_);
  }
  const attention::PagedGather& plan = step.gather;
  CPFILL_ASSIGN_OR_RETURN(const attention::PagedGather::Copy* copies,
                          DeviceCopies(step, plan.copies));
  CPFILL_RETURN_IF_ERROR(workspace_.Reserve(
      std::max(kMinBytes, attention::cuda::GatheredPagedWorkspaceBytes(args, plan))));
  return attention::cuda::GatheredPagedAttentionCuda(args, plan, workspace_.As<void>(),
                                                     workspace_.capacity(), stream_, copies);
}

absl::StatusOr<const attention::PagedGather::Copy*> CudaRingOps::DeviceCopies(
    const PagedStepPlan& plan, const std::vector<attention::PagedGather::Copy>& copies) {
  if (plan.generation == 0 || copies.empty()) return nullptr;  // uploaded with the call
  if (plan.generation != uploaded_generation_) {
    for (UploadedCopies& u : uploaded_copies_) u.plan_id = 0;
    uploaded_generation_ = plan.generation;
  }
  UploadedCopies* slot = nullptr;
  for (UploadedCopies& u : uploaded_copies_) {
    if (u.plan_id == plan.id) return u.copies.As<const attention::PagedGather::Copy>();
    if (u.plan_id == 0 && slot == nullptr) slot = &u;
  }
  // A forward with more distinct steps than slots (its plans replanned once the plan cache was
  // full) uploads with each call instead: a slot is free again only in the next forward.
  if (slot == nullptr && uploaded_copies_.size() >= kMaxUploadedPlans) return nullptr;
  if (slot == nullptr) slot = &uploaded_copies_.emplace_back();
  const size_t bytes = copies.size() * sizeof(attention::PagedGather::Copy);
  CPFILL_RETURN_IF_ERROR(slot->copies.Reserve(bytes));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(slot->copies.As<void>(), copies.data(), bytes,
                                    cudaMemcpyHostToDevice, stream_));
  slot->plan_id = plan.id;
  return slot->copies.As<const attention::PagedGather::Copy>();
}

absl::Status CudaRingOps::Launch(const CudaAttentionArgs& args) {
  // Sized on the first run of a plan; later runs find it large enough.
  CPFILL_RETURN_IF_ERROR(
      workspace_.Reserve(std::max(kMinBytes, attention::cuda::AttentionWorkspaceBytes(args))));
  return attention::cuda::PartialAttentionCuda(args, workspace_.As<void>(), workspace_.capacity(),
                                               stream_);
}

absl::Status CudaRingOps::Merge(const attention::AttentionShape& shape, int64_t rows,
                                std::span<const attention::PartialView> parts, float* o,
                                float* lse) {
  CPFILL_CHECK_ARG(parts.size() <= static_cast<size_t>(kMaxMergeParts), "merge: ", parts.size(),
                   " parts, at most ", kMaxMergeParts);
  const float* po[kMaxMergeParts];
  const float* pl[kMaxMergeParts];
  for (size_t p = 0; p < parts.size(); ++p) {
    po[p] = parts[p].o;
    pl[p] = parts[p].lse;
  }
  return attention::cuda::MergePartialsCuda(shape, rows, std::span(po, parts.size()),
                                            std::span(pl, parts.size()), o, nullptr, lse, stream_);
}

absl::Status CudaRingOps::Finish() {
  CPFILL_RETURN_IF_ERROR(cp_.Synchronize());
  DeviceBuffer::FreeRetired();
  return absl::OkStatus();
}

absl::Status CudaRingOps::BeginRun(int max_marks) {
  while (static_cast<int>(events_.size()) < max_marks) {
    cudaEvent_t e;
    CPFILL_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  next_mark_ = 0;
  return absl::OkStatus();
}

int CudaRingOps::Mark() {
  // BeginRun made room for every mark of the run; wrapping would only spoil timings.
  const int id = next_mark_ % static_cast<int>(events_.size());
  ++next_mark_;
  cudaEventRecord(events_[id], stream_);
  return id;
}

// NVTX is header-only and does nothing unless a profiler (nsys) is attached.
void CudaRingOps::PushRange(const char* name) { nvtxRangePushA(name); }
void CudaRingOps::PopRange() { nvtxRangePop(); }

double CudaRingOps::Seconds(int a, int b) const {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, events_[a], events_[b]) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return ms / 1e3;
}

}  // namespace cpfill::parallel
