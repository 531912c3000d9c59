// cpfill/runtime/handoff/kv_pull_plan.cc — the copy runs of a KV pull.
//
// Every offset is computed from a validated handle and a validated destination, whose extents
// were checked to fit in int64, so the arithmetic below cannot overflow.
#include "runtime/handoff/kv_pull_plan.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

// The destination rank's heads inside one source rank's row: the piece each row contributes.
struct HeadOverlap {
  int64_t piece_bytes = 0;       // 0: the source rank holds none of the destination's heads
  int64_t src_in_row_bytes = 0;  // where the piece starts in a source row
  int64_t dst_in_row_bytes = 0;  // and in a destination row
};

HeadOverlap OverlapOf(const KvHandleLayout& l, int src_tp_rank, int dst_heads, int dst_tp_rank) {
  const int64_t head_bytes = int64_t{l.head_dim} * static_cast<int64_t>(KvDtypeBytes(l.dtype));
  const int src_first = src_tp_rank * l.kv_heads_per_tp_rank, dst_first = dst_tp_rank * dst_heads;
  const int first = std::max(src_first, dst_first);
  const int last = std::min(src_first + l.kv_heads_per_tp_rank, dst_first + dst_heads);
  if (first >= last) return {};
  return {.piece_bytes = (last - first) * head_bytes,
          .src_in_row_bytes = (first - src_first) * head_bytes,
          .dst_in_row_bytes = (first - dst_first) * head_bytes};
}

// Where each global position's destination row sits, once the destination is validated.
struct DestinationRows {
  int64_t row_bytes = 0;
  int64_t capacity_tokens = 0;  // contiguous
  const KvContiguousDestination* contiguous = nullptr;
  const KvPagedDestination* paged = nullptr;

  int64_t RowOffset(int layer, int kind, int64_t t) const {
    if (contiguous != nullptr) {
      const int64_t kind_offset =
          kind == 0 ? contiguous->k_offset_bytes : contiguous->v_offset_bytes;
      return kind_offset + (layer * capacity_tokens + t) * row_bytes;
    }
    const int64_t block = paged->block_table[t / paged->block_tokens];
    return paged->pool.BlockOffset(layer, kind, block) + (t % paged->block_tokens) * row_bytes;
  }
  // Rows from position t on that follow t's row without a gap.
  int64_t ContiguousRows(int64_t t) const {
    return paged == nullptr ? INT64_MAX : paged->block_tokens - t % paged->block_tokens;
  }
};

absl::Status ValidateTp(const KvHandleLayout& l, const KvPullDestination& dst) {
  CPFILL_CHECK_ARG(dst.tp_size >= 1 && dst.tp_size <= l.kv_heads && l.kv_heads % dst.tp_size == 0,
                   "kv pull: destination tp_size ", dst.tp_size, " does not divide the handle's ",
                   l.kv_heads, " KV heads");
  CPFILL_CHECK_ARG(dst.tp_rank >= 0 && dst.tp_rank < dst.tp_size, "kv pull: destination tp_rank ",
                   dst.tp_rank, " is outside tp_size ", dst.tp_size);
  return absl::OkStatus();
}

absl::StatusOr<DestinationRows> ContiguousDestinationRows(const KvContiguousDestination& c,
                                                          const KvHandleLayout& l,
                                                          int64_t row_bytes) {
  const int64_t capacity = c.capacity_tokens == 0 ? l.tokens : c.capacity_tokens;
  CPFILL_CHECK_ARG(capacity >= l.tokens, "kv pull: destination capacity_tokens ", capacity,
                   " is below the handle's ", l.tokens, " tokens");
  CPFILL_CHECK_ARG(c.k_offset_bytes >= 0 && c.v_offset_bytes >= 0,
                   "kv pull: destination offsets must be non-negative (k_offset_bytes ",
                   c.k_offset_bytes, ", v_offset_bytes ", c.v_offset_bytes, ")");
  int64_t kind_bytes = 0, end = 0;
  const bool fits =
      !__builtin_mul_overflow(capacity, row_bytes * l.num_layers, &kind_bytes) &&
      !__builtin_add_overflow(std::max(c.k_offset_bytes, c.v_offset_bytes), kind_bytes, &end);
  CPFILL_CHECK_ARG(fits, "kv pull: destination of ", l.num_layers, " layers x ", capacity,
                   " tokens x ", row_bytes, " bytes past its offsets does not fit in int64");
  return DestinationRows{.row_bytes = row_bytes, .capacity_tokens = capacity, .contiguous = &c};
}

absl::StatusOr<DestinationRows> PagedDestinationRows(const KvPagedDestination& p,
                                                     const KvHandleLayout& l, int64_t row_bytes) {
  CPFILL_CHECK_ARG(p.block_tokens >= 1 && p.block_tokens <= kKvHandleMaxBlockTokens,
                   "kv pull: destination block_tokens ", p.block_tokens, " is outside [1, ",
                   kKvHandleMaxBlockTokens, "]");
  const int64_t needed = (l.tokens + p.block_tokens - 1) / p.block_tokens;
  CPFILL_CHECK_ARG(static_cast<int64_t>(p.block_table.size()) >= needed,
                   "kv pull: destination block_table has ", p.block_table.size(), " blocks; ",
                   l.tokens, " tokens in blocks of ", p.block_tokens, " need ", needed);
  CPFILL_RETURN_IF_ERROR(ValidatePoolLayout(p.pool, l.num_layers, p.block_tokens * row_bytes,
                                            "kv pull: ", "destination.pool"));
  std::vector<int32_t> used(p.block_table.begin(), p.block_table.begin() + needed);
  for (int64_t i = 0; i < needed; ++i) {
    CPFILL_CHECK_ARG(used[i] >= 0 && used[i] < p.pool.num_blocks, "kv pull: destination ",
                     "block_table[", i, "] is ", used[i], ", outside the pool's ",
                     p.pool.num_blocks, " blocks");
  }
  std::sort(used.begin(), used.end());
  const auto repeated = std::adjacent_find(used.begin(), used.end());
  CPFILL_CHECK_ARG(repeated == used.end(), "kv pull: destination block_table names block ",
                   repeated == used.end() ? 0 : *repeated, " twice");
  return DestinationRows{.row_bytes = row_bytes, .paged = &p};
}

absl::StatusOr<DestinationRows> ValidateDestination(const KvHandleLayout& l,
                                                    const KvPullDestination& dst,
                                                    int64_t row_bytes) {
  if (const auto* c = std::get_if<KvContiguousDestination>(&dst.layout)) {
    return ContiguousDestinationRows(*c, l, row_bytes);
  }
  return PagedDestinationRows(std::get<KvPagedDestination>(dst.layout), l, row_bytes);
}

// Collects runs, extending the last one when the new one continues it on both sides (the same
// piece size and strides, starting where the last one's next piece would).
class RunList {
 public:
  void Add(const KvCopyRun& run) {
    if (!runs_.empty() && Continues(runs_.back(), run)) {
      runs_.back().pieces += run.pieces;
      return;
    }
    runs_.push_back(run);
  }

  // Runs whose pieces abut on both sides become one piece.
  std::vector<KvCopyRun> Finish() && {
    for (KvCopyRun& run : runs_) {
      if (run.piece_bytes == run.src_stride_bytes && run.piece_bytes == run.dst_stride_bytes) {
        run.piece_bytes *= run.pieces;
        run.pieces = 1;
        run.src_stride_bytes = run.dst_stride_bytes = run.piece_bytes;
      }
    }
    return std::move(runs_);
  }

 private:
  static bool Continues(const KvCopyRun& last, const KvCopyRun& next) {
    return last.src_tp_rank == next.src_tp_rank && last.src_cp_rank == next.src_cp_rank &&
           last.layer == next.layer && last.kind == next.kind &&
           last.piece_bytes == next.piece_bytes && last.src_stride_bytes == next.src_stride_bytes &&
           last.dst_stride_bytes == next.dst_stride_bytes &&
           next.src_offset_bytes == last.src_offset_bytes + last.pieces * last.src_stride_bytes &&
           next.dst_offset_bytes == last.dst_offset_bytes + last.pieces * last.dst_stride_bytes;
  }

  std::vector<KvCopyRun> runs_;
};

// One source rank's rows of one layer and kind, cut where a source block, a position run or a
// destination block ends: within a cut, rows follow each other on both sides.
void AddRankRuns(const KvHandleLayout& l, const KvRankShard& shard, const HeadOverlap& heads,
                 const DestinationRows& dst, int layer, int kind, RunList* runs) {
  const int64_t src_row_bytes = l.row_bytes();
  int64_t local_row = 0;  // the rank's rows are its positions in order
  for (const sharding::PositionRun& positions : shard.positions) {
    for (int64_t t = positions.begin; t < positions.end();) {
      const int64_t row_in_block = local_row % l.block_tokens;
      const int64_t rows =
          std::min({positions.end() - t, l.block_tokens - row_in_block, dst.ContiguousRows(t)});
      const int32_t block = shard.blocks[local_row / l.block_tokens];
      runs->Add({.src_tp_rank = shard.tp_rank,
                 .src_cp_rank = shard.cp_rank,
                 .layer = layer,
                 .kind = kind,
                 .src_offset_bytes = shard.pool.BlockOffset(layer, kind, block) +
                                     row_in_block * src_row_bytes + heads.src_in_row_bytes,
                 .dst_offset_bytes = dst.RowOffset(layer, kind, t) + heads.dst_in_row_bytes,
                 .piece_bytes = heads.piece_bytes,
                 .pieces = rows,
                 .src_stride_bytes = src_row_bytes,
                 .dst_stride_bytes = dst.row_bytes});
      t += rows;
      local_row += rows;
    }
  }
}

}  // namespace

int64_t KvPullPlan::total_bytes() const {
  int64_t total = 0;
  for (const KvCopyRun& run : runs) total += run.bytes();
  return total;
}

absl::StatusOr<KvPullPlan> PlanKvPull(const KvHandle& handle, const KvPullDestination& dst) {
  CPFILL_RETURN_IF_ERROR(ValidateKvHandle(handle));
  const KvHandleLayout& l = handle.layout;
  CPFILL_RETURN_IF_ERROR(ValidateTp(l, dst));
  KvPullPlan plan;
  plan.kv_heads_per_dst_rank = l.kv_heads / dst.tp_size;
  plan.dst_row_bytes = int64_t{plan.kv_heads_per_dst_rank} * l.head_dim *
                       static_cast<int64_t>(KvDtypeBytes(l.dtype));
  CPFILL_ASSIGN_OR_RETURN(DestinationRows dst_rows,
                          ValidateDestination(l, dst, plan.dst_row_bytes));

  RunList runs;
  for (const KvRankShard& shard : handle.ranks) {
    const HeadOverlap heads = OverlapOf(l, shard.tp_rank, plan.kv_heads_per_dst_rank, dst.tp_rank);
    if (heads.piece_bytes == 0) continue;
    for (int layer = 0; layer < l.num_layers; ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        AddRankRuns(l, shard, heads, dst_rows, layer, kind, &runs);
      }
    }
  }
  plan.runs = std::move(runs).Finish();
  return plan;
}

}  // namespace cpfill::runtime
