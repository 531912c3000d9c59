// cpfill/attention/cuda/attention_cuda.h — the CUDA backend of the attention primitive.
//
// Same semantics as attention.h (fused varseq batch, per-token global positions, causal
// `k_pos <= q_pos`, GQA, O + natural-log LSE, rows that see nothing get O = 0 and LSE = -inf),
// on device memory: Q/K/V in bf16, accumulation in fp32. Launchers validate, take a stream, never
// synchronize and never allocate: a workspace (AttentionWorkspaceBytes) is passed in.
//
//   CudaAttentionArgs a{.shape = shape, .q = dq, .q_pos = dqpos, .q_tokens = nq, .k = dk, ...,
//                       .slices = host_slices.data(), .num_slices = n,
//                       .output = OutputMode::kMergeIntoFloat32, .o = d_running_o,
//                       .lse = d_running_lse};
//   CPFILL_RETURN_IF_ERROR(PartialAttentionCuda(a, workspace, workspace_bytes, stream));
//
// Output modes: kBfloat16 and kFloat32 write O (and LSE) for every query row; rows covered by no
// slice are written empty. kMergeIntoFloat32 folds this call's result into a running fp32
// (O, LSE) in place (App. B eq. 4), so a ring loop needs no separate merge pass; rows covered by
// no slice are left as they are (merging an empty result changes nothing).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "attention/attention.h"

namespace cpfill::attention::cuda {

enum class OutputMode { kBfloat16, kFloat32, kMergeIntoFloat32 };

// Layouts as attention.h: q [q_tokens, num_heads, head_dim], k/v [kv_tokens, num_kv_heads,
// head_dim] (bf16, device); q_pos/k_pos int32 (device); o [q_tokens, num_heads, head_dim] (bf16
// or fp32 by mode, device); lse [q_tokens, num_heads] fp32 (device). `slices` is HOST memory: the
// launcher copies the descriptors into the kernel's parameters.
struct CudaAttentionArgs {
  AttentionShape shape;
  const __nv_bfloat16* q = nullptr;
  const int32_t* q_pos = nullptr;
  int64_t q_tokens = 0;
  const __nv_bfloat16* k = nullptr;
  const __nv_bfloat16* v = nullptr;
  const int32_t* k_pos = nullptr;
  int64_t kv_tokens = 0;
  const SequenceSlice* slices = nullptr;
  int64_t num_slices = 0;
  OutputMode output = OutputMode::kBfloat16;
  void* o = nullptr;
  float* lse = nullptr;
  // Set while a communication kernel (an NCCL exchange) runs beside this launch: the persistent
  // Hopper kernel then leaves SmsForCommunication() SMs free, or it would hold every SM until it
  // ends and the exchange could not start (measured: CP4 over sockets 46 ms instead of 32).
  bool communication_in_flight = false;
  // With communication_in_flight: an event recorded when that exchange has ended, or null. The
  // Hopper kernel's SMs left free for it then join the launch once it has (a second grid on the
  // same work items), so the exchange costs the kernel SMs only while it runs.
  cudaEvent_t exchange_done = nullptr;
  // Set: k/v are a KV cache's block pools, read in place through this table (attention.h); the
  // decode kernel reads them (any rows per slice; it reads a slice's keys once per m16 tile of
  // packed rows, so many rows per slice cost many reads).
  const PagedKv* paged = nullptr;
  // A prefill step's paged K/V (InPlacePagedAttentionCuda sets it): where the Hopper kernel reads
  // them in place (ReadsPagedPrefillInPlace), a call with a slice of more than a few rows goes to
  // it, not to the decode kernel. Decode steps leave it unset: their roots stay on the decode
  // kernel, which splits the keys.
  bool paged_prefill = false;
};

// The SMs left free beside an exchange in flight (knob CPFILL_COMMUNICATION_SMS, default 4).
int SmsForCommunication();

// The CPU contract's view of `a` (attention.h), for its validators: device pointers stand in for
// host ones (the validators check them for null only).
AttentionParams ShapeView(const CudaAttentionArgs& a);

// Head dimensions with compiled kernels.
bool SupportedHeadDim(int head_dim);

// Device workspace the launch needs (per-key-tile position summaries and the Hopper kernel's
// work-item counter; where the call runs its keys in parts, key_split.h, their fp32 partials
// too); 0 when no slice has work.
size_t AttentionWorkspaceBytes(const CudaAttentionArgs& args);

// InvalidArgument for bad shapes, unsupported head dims, slices out of range or overlapping in
// query rows, a too small workspace; Internal for a failed launch (with the CUDA error text).
absl::Status PartialAttentionCuda(const CudaAttentionArgs& args, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream);

// Exact merge of `o_parts.size()` fp32 partials (device pointers) [rows, heads, head_dim] with
// their LSE [rows, heads] into o_out (fp32, or bf16 when o_out_bf16 is set) and lse_out. fp32
// math, 16-byte loads, -inf safe. At most kMaxMergeParts parts per call; the outputs must not
// alias the parts.
inline constexpr int kMaxMergeParts = 16;
absl::Status MergePartialsCuda(const AttentionShape& shape, int64_t rows,
                               std::span<const float* const> o_parts,
                               std::span<const float* const> lse_parts, float* o_out,
                               __nv_bfloat16* o_out_bf16, float* lse_out, cudaStream_t stream);

// The forward kernel PartialAttentionCuda runs on the current device: "hopper-wgmma" (sm_90a:
// TMA, wgmma, warp-specialized) on compute capability 9.0, else "mma-sync" (sm_80+).
// CPFILL_ATTENTION_KERNEL=mma forces the mma.sync kernel everywhere (for comparison).
const char* AttentionKernelName();

// True when PartialAttentionCuda reads paged K/V of this shape and layout in place for query
// rows of a prefill (the Hopper kernel through tensor maps over the pools: compute capability
// 9.0, head dim 64 or 128, `host_table` given, blocks of a multiple of 32 tokens whose stride is
// their rows, as in the KV cache). Elsewhere only
// the decode kernel reads paged K/V, and a prefill step gathers its keys first.
bool ReadsPagedPrefillInPlace(const AttentionShape& shape, const PagedKv& paged);

// Number of CUDA devices (0 when there is no driver or no GPU); never fails.
int DeviceCount();

}  // namespace cpfill::attention::cuda
