// cpfill/attention/attention.h — the partial-attention primitive and the exact merge of partials.
//
// Everything in cpfill's attention is one primitive: a fused variable-length batch of query rows
// attending to key/value rows, each token carrying its *global position within its sequence*.
// Causal masking is `k_pos <= q_pos`, so the same call is right for a ring step's chunk pair, a
// partial prefill after P cached tokens, or a decode query. It returns the output O and the
// log-sum-exp LSE, which is what lets partial results over disjoint key sets be merged exactly
// (paper App. B eq. 4; Hydragen eq. 5).
//
//   AttentionParams p{.shape = shape, .q = q, .q_pos = q_pos, .q_tokens = nq, ...,
//                     .slices = slices.data(), .num_slices = slices.size(), .o = o, .lse = lse};
//   CPFILL_RETURN_IF_ERROR(PartialAttentionCpu(p, &pool));
//   CPFILL_RETURN_IF_ERROR(MergeInto(p.shape, nq, o_acc, lse_acc, o, lse, &pool));
//
// This header is backend-neutral; attention/cpu/ holds the CPU kernel, attention/cuda/ the GPU
// one. No MPI, NCCL or UCX here (dependency rule).
#pragma once

#include <cstdint>
#include <limits>
#include <span>

#include "absl/status/status.h"
#include "base/thread_pool.h"

namespace cpfill::attention {

// Position of a padding token. A padding key is never visible; a padding query sees nothing.
inline constexpr int32_t kPadPosition = -1;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttentionShape {
  int num_heads = 0;     // query heads on this rank
  int num_kv_heads = 0;  // key/value heads on this rank; divides num_heads (GQA group size)
  int head_dim = 0;
  float softmax_scale = 0.0f;  // applied to q.k before the softmax; usually 1/sqrt(head_dim)
  bool causal = true;          // key visible iff k_pos <= q_pos (and k_pos is not padding)

  int group_size() const { return num_heads / num_kv_heads; }
  bool operator==(const AttentionShape&) const = default;
};

// One sequence's part of a fused batch: query rows [q_begin, q_begin + q_len) attend to key rows
// [kv_begin, kv_begin + kv_len). Slices may share key rows but never query rows.
struct SequenceSlice {
  int64_t q_begin = 0;
  int64_t q_len = 0;
  int64_t kv_begin = 0;
  int64_t kv_len = 0;
  bool operator==(const SequenceSlice&) const = default;
};

// Tensor layouts (row-major, fp32, host memory for the CPU backend):
//   q      [q_tokens, num_heads, head_dim]
//   k, v   [kv_tokens, num_kv_heads, head_dim]
//   q_pos  [q_tokens]   global position of each query in its sequence, or kPadPosition
//   k_pos  [kv_tokens]  global position of each key in its sequence, or kPadPosition
//   o      [q_tokens, num_heads, head_dim]   written for every row
//   lse    [q_tokens, num_heads]             natural log; written for every row
// Contract: every query row in [0, q_tokens) is written. A row covered by no slice, a padding
// row, and a row that sees no key all get O = 0 and LSE = -inf. Nothing is NaN unless inputs are.
struct AttentionParams {
  AttentionShape shape;
  const float* q = nullptr;
  const int32_t* q_pos = nullptr;
  int64_t q_tokens = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  const int32_t* k_pos = nullptr;
  int64_t kv_tokens = 0;
  const SequenceSlice* slices = nullptr;
  int64_t num_slices = 0;
  float* o = nullptr;
  float* lse = nullptr;
};

// K/V read in place from a block pool (a KV cache, runtime/kv/kv_cache.h) instead of contiguous
// rows: the keys of a slice whose kv_begin is a sequence's first local row, or a block boundary
// inside its rows, lie in that sequence's blocks, key r of the slice in block
// table[table_begin + r / block_tokens], row r % block_tokens (table_begin: the sequence's first
// entry plus the blocks before kv_begin), where block b starts at k (or v) + b *
// block_stride_bytes and rows are
// [num_kv_heads, head_dim] each. k/v of the call then point at the pools' block 0; k_pos stays
// one position per local row. This saves copying every cached row out of its blocks on each
// layer of each decode step (the gather cost 11.9 of a 36 ms step at 128K on an H100).
struct PagedKv {
  const int32_t* table = nullptr;  // in the kernel's memory (device on CUDA)
  int block_tokens = 0;
  int64_t block_stride_bytes = 0;
  // Host memory, one entry per sequence, ascending kv_begin: its first local key row and its
  // first entry in `table`.
  std::span<const int64_t> seq_kv_begin;
  std::span<const int64_t> seq_table_begin;
  // Optional: `table` in host memory. With it the caller lets the kernels' callers batch the
  // queries of sequences whose tables start with the same blocks (a shared prefix:
  // prefix_batched.h FindSharedBlocks); empty, every sequence reads its own keys.
  std::span<const int32_t> host_table;
  // The caller's name for these tables and sequences, nonzero when it keeps them for several
  // calls (a forward's layers): a ring backend then plans prefix batching once for all the calls
  // with the same generation and slices (RingOps::PlanPagedStep). 0: planned every call.
  uint64_t generation = 0;
  // Blocks in each pool (0: not given). The Hopper prefill kernel reads paged K/V through a
  // tensor map over the whole pool, so it needs the pool's size, or host_table to bound it.
  int64_t pool_blocks = 0;
  // A prefill step over these blocks reads them in place where the backend can, rather than
  // gathering them first (which is faster where the copy fits in memory).
  bool prefill_in_place = false;

  // The table entry where the keys starting at local row `kv_begin` begin: that of the last
  // sequence that starts at or before it (sequences with no rows share the next one's begin),
  // plus the whole blocks between; -1 when kv_begin is before every sequence or not on a block
  // boundary of the sequence it falls in.
  int64_t TableBegin(int64_t kv_begin) const;
  // InvalidArgument unless the geometry is positive, a row of `row_bytes` fits a block's
  // stride, the spans match and ascend, and every slice with keys starts at a sequence or a
  // block boundary inside one.
  absl::Status Validate(int64_t row_bytes, const SequenceSlice* slices, int64_t num_slices) const;
};

// Checks shapes, pointers and that every slice lies inside the tensors and slices do not share
// query rows. InvalidArgument naming the problem otherwise.
absl::Status ValidateAttentionParams(const AttentionParams& p);

// Counts (query, key) pairs the mask leaves visible, summed over slices (one head). Attention
// FLOPs are 4 * head_dim * num_heads * VisiblePairs: the masked part is not counted.
int64_t CountVisiblePairs(const AttentionParams& p);

// CPU kernel (attention/cpu/): blocked online softmax over query and key tiles, fp32, with the
// query heads that share a KV head processed together (GQA). Tiles the mask hides entirely are
// skipped; tiles it shows entirely run without per-element masking. Runs on `pool` (may be null:
// single-threaded).
absl::Status PartialAttentionCpu(const AttentionParams& p, ThreadPool* pool);

// A partial result over some key set: o [rows, num_heads, head_dim], lse [rows, num_heads].
struct PartialView {
  const float* o = nullptr;
  const float* lse = nullptr;
};

// Exact merge of partials over disjoint key sets (App. B eq. 4): for each row and head,
//   lse = log(sum_s exp(lse_s)),  o = sum_s exp(lse_s - lse) * o_s.
// -inf safe: parts with LSE = -inf contribute nothing; a row that is -inf in every part gets
// O = 0, LSE = -inf. Never produces NaN from finite or -inf inputs. o_out/lse_out may alias the
// first part.
absl::Status MergePartials(const AttentionShape& shape, int64_t rows,
                           std::span<const PartialView> parts, float* o_out, float* lse_out,
                           ThreadPool* pool);

// Running merge: (o_acc, lse_acc) <- merge((o_acc, lse_acc), (o, lse)), in place.
absl::Status MergeInto(const AttentionShape& shape, int64_t rows, float* o_acc, float* lse_acc,
                       const float* o, const float* lse, ThreadPool* pool);

}  // namespace cpfill::attention
