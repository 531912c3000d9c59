// cpfill/attention/sparq/cuda/sparq_cuda.h — SparQ decode attention (../sparq.h) on the GPU:
// three kernels on one stream, no host synchronisation.
//   1. ApproxScores  grid (chunks of 1024 positions, sequences x KV heads): i1 from the group's
//      summed |q|, then for every position the r gathered components of its key row (read from
//      the existing d-contiguous K layout: each component read touches its 32-byte sector, so
//      at r = 16 of d = 128 about 7 of a row's 8 sectors are fetched; README.md), the
//      approximate logits of the G query heads (to the workspace) and each chunk's softmax
//      normaliser per head.
//   2. TopK          one CTA per (sequence, KV head): the global LSE per head, ranking keys, a
//      4-pass 8-bit radix select of the k-th key (window flag in the top bit), then the chosen
//      positions collected in position order (ties: lower position, as SelectedBefore), alpha.
//   3. GatherAttend  one CTA per (sequence, KV head): the full K/V rows of the chosen positions,
//      exact softmax per query head, y = alpha * attn + (1 - alpha) * v_sum / S.
//
//   SparqCudaArgs a{...};
//   const size_t ws_bytes = SparqWorkspaceBytes(a);
//   CPFILL_RETURN_IF_ERROR(LaunchSparqAttention(a, ws, ws_bytes, stream));
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "attention/sparq/sparq.h"

namespace cpfill::attention::sparq::cuda {

inline constexpr int kMaxK = 1024;        // selected positions per group (shared scores)
inline constexpr int kScoreChunk = 1024;  // positions per ApproxScores CTA

// Device tensors, row-major:
//   q        [num_seqs, num_heads, head_dim] bf16
//   k, v     [kv_rows, num_kv_heads, head_dim] bf16; sequence s owns rows kv_begin[s] + [0,
//   kv_len[s])
//            at positions 0 .. kv_len[s]-1 (one rank: the CP form runs on the CPU backend)
//   kv_begin, kv_len [num_seqs] int64
//   v_sum    [num_seqs, num_kv_heads, head_dim] fp32: sum of V over the sequence, kept by the KV
//            cache (required: reading V to average it would cost the dense bytes)
//   o        [num_seqs, num_heads, head_dim] fp32
//   selected [num_seqs, num_kv_heads, k] int32, optional: chosen positions ascending, -1 after
//            min(k, kv_len)
struct SparqCudaArgs {
  SparqShape shape;
  SparqConfig config;
  const __nv_bfloat16* q = nullptr;
  const __nv_bfloat16* k = nullptr;
  const __nv_bfloat16* v = nullptr;
  const int64_t* kv_begin = nullptr;
  const int64_t* kv_len = nullptr;
  int64_t num_seqs = 0;
  int64_t kv_rows = 0;     // rows of k and v
  int64_t max_kv_len = 0;  // the longest kv_len (host-side: sizes the grid)
  const float* v_sum = nullptr;
  float* o = nullptr;
  int32_t* selected = nullptr;
};

// head_dim 64 or 128, group size 1, 2, 4, 8 or 16, 1 <= r <= head_dim, 1 <= k <= kMaxK.
absl::Status ValidateSparqCudaArgs(const SparqCudaArgs& a);
// Workspace: logits [num_heads, kv_rows] f32, keys [num_kv_heads, kv_rows] u32, chunk
// normalisers [num_seqs, num_heads, chunks] 2 x f32, lse and alpha [num_seqs, num_heads] f32,
// selection [num_seqs, num_kv_heads, k] i32 (unless `selected` is given).
size_t SparqWorkspaceBytes(const SparqCudaArgs& a);
absl::Status LaunchSparqAttention(const SparqCudaArgs& a, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

// Bytes the three kernels move from/to memory for this call, as a model: K components by
// 32-byte sectors (sector model) or by r components (the paper's M_SparQ with K stored
// S-contiguous), the chosen K/V rows, v_sum, the workspace traffic. For the benchmark.
struct SparqBytes {
  double paper = 0;      // eq. 9 per KV head x 2 bytes: S r + 2 k d + 4 d (GQA: r once per group)
  double sectors = 0;    // this implementation's K component reads by 32-byte sectors
  double workspace = 0;  // logits written and read, keys, radix passes
  double dense = 0;      // the dense decode's K + V read
};
SparqBytes ModelSparqBytes(const SparqShape& shape, const SparqConfig& config, int64_t seq_len,
                           int64_t num_seqs);

}  // namespace cpfill::attention::sparq::cuda
