// cpfill/attention/cuda/attention_decode.h — the split-KV (flash-decoding) kernel behind
// PartialAttentionCuda for calls whose slices hold a few query rows each (decode steps).
//
// A decode step gives each sequence one query row (a ring pass-Q step: 0 or 1 rows per slice, a
// short partial prefill a few) against a long KV. The prefill kernels tile 128 query rows, so
// such a call would waste >99% of its work and run one CTA per (sequence, KV head) through the
// whole KV. This kernel instead:
//   1. packs the query heads that share a KV head, times the slice's rows (q_len * group rows),
//      into m16 tiles, so every K/V tile feeds the whole group (16:1 and one row: one tile);
//   2. splits each slice's keys over enough CTAs to fill the GPU once (one wave), each CTA's
//      four warps taking 16 keys of every 64-key tile; per CTA one partial (O, LSE) per row
//      goes to the workspace;
//   3. a combine kernel merges the splits exactly (-inf safe) and applies the output mode.
// Semantics and layouts are PartialAttentionCuda's (attention_cuda.h); the public API is
// unchanged: PartialAttentionCuda and AttentionWorkspaceBytes dispatch here.
//
//   if (DecodeAttentionApplies(a)) return LaunchDecodeAttention(a, ws, ws_bytes, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "attention/cuda/attention_cuda.h"

namespace cpfill::attention::cuda::internal {

// Calls whose every slice has at most this many query rows take the decode kernel. Its cost
// is the K/V read once per (KV head, m16 tile of packed rows); at 16:1 and 4 rows that is 4
// tiles, read from L2 after the first, while the prefill kernel would run one CTA per
// (sequence, KV head) with no key split: slower at any KV length past a few thousand keys.
// Beyond 4 rows the prefill kernel's 128-row tiles start to fill (a partial prefill).
inline constexpr int kMaxDecodeQueryRows = 4;

// The decode kernel loads Q, K and V 16 bytes at a time.
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// True when `a` goes to the decode kernel: CPFILL_DECODE_KERNEL is on, the head dim is
// compiled (64, 128), Q/K/V are 16-byte aligned, and some slice has query rows while none has
// more than kMaxDecodeQueryRows (paged K/V: any number, unless PagedPrefillOnHopper).
bool DecodeAttentionApplies(const CudaAttentionArgs& a);

// A paged prefill call (CudaAttentionArgs::paged_prefill) with a slice of more than
// kMaxDecodeQueryRows rows, on a device and in a layout the Hopper kernel reads in place
// (ReadsPagedPrefillInPlace); elsewhere the decode kernel reads paged K/V, whatever its rows.
bool PagedPrefillOnHopper(const CudaAttentionArgs& a);
// The same without the row limit: the kernel runs any rows per slice, reading each slice's keys
// once per m16 tile of packed rows (prefix_batched_cuda.h gives it a shared prefix under a few
// decode rows this way).
bool DecodeKernelCanRun(const CudaAttentionArgs& a);

// SMs of the current device; 1 where they cannot be read (no device: the plans stay valid).
int SmCount();

// The workspace the decode launch needs: the per-split partial O (fp32) and LSE.
size_t DecodeWorkspaceBytes(const CudaAttentionArgs& a);

// Runs the decode and combine kernels on `stream` (validated args; DecodeAttentionApplies).
// Rows of slices with no keys are written empty (merge mode: left as they are); rows in no slice
// are the caller's (PartialAttentionCuda fills them first).
absl::Status LaunchDecodeAttention(const CudaAttentionArgs& a, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace cpfill::attention::cuda::internal
