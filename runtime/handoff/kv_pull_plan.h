// cpfill/runtime/handoff/kv_pull_plan.h — which bytes a decode rank copies out of a prefill's KV
// hand-off (runtime/handoff/kv_handle.h) and where they land: pure arithmetic, no transport. The
// UCX puller issues one get per piece of each run; tests run the same plan with memcpy on fake
// pools.
//
// The decode side picks its own TP size (it must divide the KV heads; 1 gathers every head) and
// its own layout:
//   contiguous: K and V each [num_layers][capacity_tokens][kv_heads_per_dst_rank][head_dim] of the
//     handle's dtype, at k_offset_bytes and v_offset_bytes of the destination region;
//   paged: blocks of block_tokens rows in a pool laid out as KvPoolLayout says (a KvCache's:
//     KvPoolLayout::OfKvCache), global position t in block block_table[t / block_tokens] at row
//     t % block_tokens.
// A destination offset is relative to the region's first byte. A caller whose K and V are two
// allocations sets both offsets to 0 and picks the allocation by the run's kind.
//
// Runs stay few: a run covers up to one source block (more when blocks and destination rows both
// continue); when the TP sizes differ a row splits by head ranges, and the run is strided (a piece
// per row) instead of one run per row.
//
//   KvPullDestination dst{.tp_size = 1, .tp_rank = 0,
//                         .layout = KvContiguousDestination{.v_offset_bytes = k_bytes}};
//   CPFILL_ASSIGN_OR_RETURN(KvPullPlan plan, PlanKvPull(handle, dst));
//   for (const KvCopyRun& run : plan.runs)
//     for (int64_t i = 0; i < run.pieces; ++i)
//       Get(run.src_tp_rank, run.src_cp_rank, run.src_offset_bytes + i * run.src_stride_bytes,
//           dst_base + run.dst_offset_bytes + i * run.dst_stride_bytes, run.piece_bytes);
#pragma once

#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/handoff/kv_handle.h"

namespace cpfill::runtime {

struct KvContiguousDestination {
  int64_t capacity_tokens = 0;  // the tensors' token dimension, >= the handle's tokens; 0: equal
  int64_t k_offset_bytes = 0;
  int64_t v_offset_bytes = 0;
};

struct KvPagedDestination {
  int block_tokens = 0;
  KvPoolLayout pool;                     // blocks of block_tokens destination rows
  std::span<const int32_t> block_table;  // >= ceil(tokens / block_tokens) distinct ids; borrowed
};

struct KvPullDestination {
  int tp_size = 1;
  int tp_rank = 0;  // the plan is for this decode rank: heads [tp_rank * H / tp_size, ...)
  std::variant<KvContiguousDestination, KvPagedDestination> layout;
};

// `pieces` copies of `piece_bytes`: piece i from src_offset_bytes + i * src_stride_bytes of the
// source rank's pool (KvHandle's KvPoolLayout; add its transport's pool_address for UCX) to
// dst_offset_bytes + i * dst_stride_bytes of the destination. Contiguous runs have pieces == 1.
struct KvCopyRun {
  int src_tp_rank = 0;
  int src_cp_rank = 0;
  int layer = 0;
  int kind = 0;  // 0 = K, 1 = V
  int64_t src_offset_bytes = 0;
  int64_t dst_offset_bytes = 0;
  int64_t piece_bytes = 0;
  int64_t pieces = 1;
  int64_t src_stride_bytes = 0;
  int64_t dst_stride_bytes = 0;

  int64_t bytes() const { return piece_bytes * pieces; }
  bool operator==(const KvCopyRun&) const = default;
};

struct KvPullPlan {
  int kv_heads_per_dst_rank = 0;
  int64_t dst_row_bytes = 0;  // one token of one layer's K (or V) on the destination rank
  // Runs grouped by source rank (tp-major), then layer, then K before V, in position order.
  std::vector<KvCopyRun> runs;

  // num_layers * 2 * tokens * dst_row_bytes once complete.
  int64_t total_bytes() const;
};

// The runs that fill destination rank dst.tp_rank with every position of the handle's request.
// InvalidArgument naming the problem: an invalid handle (ValidateKvHandle), a decode TP size that
// does not divide the KV heads, a rank outside it, a contiguous capacity below the tokens, a paged
// table too short or with ids outside the pool or repeated, a pool too small for its blocks, or
// destination offsets that overflow int64.
absl::StatusOr<KvPullPlan> PlanKvPull(const KvHandle& handle, const KvPullDestination& dst);

}  // namespace cpfill::runtime
