// Backend-neutral parts of attention.h: parameter validation, the visible-pair count used for FLOP
// accounting, and the exact merge of partial results (paper App. B eq. 4).

#include "attention/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/online_softmax.h"
#include "base/status.h"

namespace cpfill::attention {
namespace {

absl::Status ValidateShape(const AttentionShape& s) {
  CPFILL_CHECK_ARG(s.num_heads > 0, "num_heads must be > 0, got ", s.num_heads);
  CPFILL_CHECK_ARG(s.num_kv_heads > 0, "num_kv_heads must be > 0, got ", s.num_kv_heads);
  CPFILL_CHECK_ARG(s.head_dim > 0, "head_dim must be > 0, got ", s.head_dim);
  CPFILL_CHECK_ARG(s.num_heads % s.num_kv_heads == 0, "num_heads (", s.num_heads,
                   ") is not a multiple of num_kv_heads (", s.num_kv_heads, ")");
  CPFILL_CHECK_ARG(std::isfinite(s.softmax_scale), "softmax_scale must be finite, got ",
                   s.softmax_scale);
  return absl::OkStatus();
}

// Rows handed to one pool item by the merge: large enough that the claim (a mutex) is noise,
// small enough that a few thousand rows still spread over the pool.
constexpr int64_t kMergeRowsPerItem = 16;

}  // namespace

int64_t PagedKv::TableBegin(int64_t kv_begin) const {
  const auto it = std::upper_bound(seq_kv_begin.begin(), seq_kv_begin.end(), kv_begin);
  if (it == seq_kv_begin.begin() || block_tokens <= 0) return -1;
  const int64_t into = kv_begin - *(it - 1);
  if (into % block_tokens != 0) return -1;
  return seq_table_begin[(it - seq_kv_begin.begin()) - 1] + into / block_tokens;
}

absl::Status PagedKv::Validate(int64_t row_bytes, const SequenceSlice* slices,
                               int64_t num_slices) const {
  CPFILL_CHECK_ARG(table != nullptr && block_tokens > 0 && row_bytes > 0 &&
                       block_stride_bytes / block_tokens >= row_bytes,
                   "paged K/V: table ", table == nullptr ? "null" : "set", ", ", block_tokens,
                   " tokens per block, a block stride of ", block_stride_bytes,
                   " bytes for rows of ", row_bytes, " bytes");
  CPFILL_CHECK_ARG(seq_kv_begin.size() == seq_table_begin.size() &&
                       std::is_sorted(seq_kv_begin.begin(), seq_kv_begin.end()),
                   "paged K/V: ", seq_kv_begin.size(), " sequence begins (ascending) and ",
                   seq_table_begin.size(), " table begins");
  for (int64_t i = 0; i < num_slices; ++i) {
    if (slices[i].kv_len == 0 || slices[i].q_len == 0) continue;
    CPFILL_CHECK_ARG(TableBegin(slices[i].kv_begin) >= 0, "paged K/V: slice ", i,
                     "'s keys start at local row ", slices[i].kv_begin,
                     ", where neither a sequence of the block table nor one of its blocks starts");
  }
  return absl::OkStatus();
}

absl::Status ValidateAttentionParams(const AttentionParams& p) {
  CPFILL_RETURN_IF_ERROR(ValidateShape(p.shape));
  CPFILL_CHECK_ARG(p.q_tokens >= 0, "q_tokens must be >= 0, got ", p.q_tokens);
  CPFILL_CHECK_ARG(p.kv_tokens >= 0, "kv_tokens must be >= 0, got ", p.kv_tokens);
  CPFILL_CHECK_ARG(p.num_slices >= 0, "num_slices must be >= 0, got ", p.num_slices);
  if (p.q_tokens > 0) {
    CPFILL_CHECK_ARG(p.q != nullptr, "q is null with q_tokens = ", p.q_tokens);
    CPFILL_CHECK_ARG(p.q_pos != nullptr, "q_pos is null with q_tokens = ", p.q_tokens);
    CPFILL_CHECK_ARG(p.o != nullptr, "o is null with q_tokens = ", p.q_tokens);
    CPFILL_CHECK_ARG(p.lse != nullptr, "lse is null with q_tokens = ", p.q_tokens);
  }
  if (p.kv_tokens > 0) {
    CPFILL_CHECK_ARG(p.k != nullptr, "k is null with kv_tokens = ", p.kv_tokens);
    CPFILL_CHECK_ARG(p.v != nullptr, "v is null with kv_tokens = ", p.kv_tokens);
    CPFILL_CHECK_ARG(p.k_pos != nullptr, "k_pos is null with kv_tokens = ", p.kv_tokens);
  }
  if (p.num_slices > 0) {
    CPFILL_CHECK_ARG(p.slices != nullptr, "slices is null with num_slices = ", p.num_slices);
  }
  // Bounds are compared as `len <= tokens - begin` so that huge values cannot overflow.
  for (int64_t i = 0; i < p.num_slices; ++i) {
    const SequenceSlice& s = p.slices[i];
    CPFILL_CHECK_ARG(s.q_begin >= 0 && s.q_len >= 0 && s.kv_begin >= 0 && s.kv_len >= 0, "slice ",
                     i, " has a negative field: q [", s.q_begin, ", +", s.q_len, "), kv [",
                     s.kv_begin, ", +", s.kv_len, ")");
    CPFILL_CHECK_ARG(s.q_begin <= p.q_tokens && s.q_len <= p.q_tokens - s.q_begin, "slice ", i,
                     " query rows [", s.q_begin, ", +", s.q_len,
                     ") exceed q_tokens = ", p.q_tokens);
    CPFILL_CHECK_ARG(s.kv_begin <= p.kv_tokens && s.kv_len <= p.kv_tokens - s.kv_begin, "slice ", i,
                     " key rows [", s.kv_begin, ", +", s.kv_len,
                     ") exceed kv_tokens = ", p.kv_tokens);
  }
  // Two slices writing the same query row would race in the kernel and make O ambiguous.
  // Empty slices own no rows, so they are left out of the overlap check.
  std::vector<int64_t> order;
  order.reserve(p.num_slices);
  for (int64_t i = 0; i < p.num_slices; ++i) {
    if (p.slices[i].q_len > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return p.slices[a].q_begin < p.slices[b].q_begin; });
  for (size_t j = 1; j < order.size(); ++j) {
    const SequenceSlice& prev = p.slices[order[j - 1]];
    const SequenceSlice& next = p.slices[order[j]];
    CPFILL_CHECK_ARG(prev.q_begin + prev.q_len <= next.q_begin, "slices ", order[j - 1], " and ",
                     order[j], " share query rows: [", prev.q_begin, ", ",
                     prev.q_begin + prev.q_len, ") and [", next.q_begin, ", ",
                     next.q_begin + next.q_len, ")");
  }
  return absl::OkStatus();
}

int64_t CountVisiblePairs(const AttentionParams& p) {
  // Invalid params have no meaningful count; callers validate first.
  if (!ValidateAttentionParams(p).ok()) return 0;
  int64_t total = 0;
  std::vector<int32_t> keys;
  for (int64_t si = 0; si < p.num_slices; ++si) {
    const SequenceSlice& s = p.slices[si];
    if (s.q_len == 0 || s.kv_len == 0) continue;
    keys.clear();
    for (int64_t j = s.kv_begin; j < s.kv_begin + s.kv_len; ++j) {
      if (p.k_pos[j] >= 0) keys.push_back(p.k_pos[j]);
    }
    // Keys of one sequence usually arrive in position order; skip the sort then.
    if (!std::is_sorted(keys.begin(), keys.end())) std::sort(keys.begin(), keys.end());
    const int64_t num_keys = static_cast<int64_t>(keys.size());
    for (int64_t i = s.q_begin; i < s.q_begin + s.q_len; ++i) {
      const int32_t qp = p.q_pos[i];
      if (qp < 0) continue;
      if (!p.shape.causal) {
        total += num_keys;
      } else {
        total += std::upper_bound(keys.begin(), keys.end(), qp) - keys.begin();
      }
    }
  }
  return total;
}

absl::Status MergePartials(const AttentionShape& shape, int64_t rows,
                           std::span<const PartialView> parts, float* o_out, float* lse_out,
                           ThreadPool* pool) {
  CPFILL_RETURN_IF_ERROR(ValidateShape(shape));
  CPFILL_CHECK_ARG(rows >= 0, "rows must be >= 0, got ", rows);
  if (rows == 0) return absl::OkStatus();
  CPFILL_CHECK_ARG(o_out != nullptr && lse_out != nullptr,
                   "merge output is null with rows = ", rows);
  for (size_t s = 0; s < parts.size(); ++s) {
    CPFILL_CHECK_ARG(parts[s].o != nullptr && parts[s].lse != nullptr, "merge part ", s,
                     " has a null pointer with rows = ", rows);
  }
  const int num_heads = shape.num_heads;
  const int head_dim = shape.head_dim;
  const int num_parts = static_cast<int>(parts.size());

  // One (row, head) at a time. Every part's value for an element is read before the output
  // element is written, so o_out/lse_out may alias the first part.
  auto merge_rows = [&](int64_t item) {
    const int64_t row_begin = item * kMergeRowsPerItem;
    const int64_t row_end = std::min(rows, row_begin + kMergeRowsPerItem);
    // Weights of the parts for one (row, head); small fixed size avoids allocation per call.
    constexpr int kInlineParts = 16;
    float inline_w[kInlineParts];
    std::vector<float> heap_w;
    float* w = inline_w;
    if (num_parts > kInlineParts) {
      heap_w.resize(num_parts);
      w = heap_w.data();
    }
    for (int64_t r = row_begin; r < row_end; ++r) {
      for (int h = 0; h < num_heads; ++h) {
        const int64_t lse_idx = r * num_heads + h;
        const int64_t o_off = lse_idx * head_dim;
        LseMerge<float> merge;
        for (int s = 0; s < num_parts; ++s) merge.Add(parts[s].lse[lse_idx], s);
        float* o_dst = o_out + o_off;
        if (merge.empty()) {
          // Every part saw no key (or there are no parts): the empty-row convention.
          for (int d = 0; d < head_dim; ++d) o_dst[d] = 0.0f;
          lse_out[lse_idx] = kNegInf;
          continue;
        }
        float rest = 0.0f;
        for (int s = 0; s < num_parts; ++s) {
          w[s] = merge.Weight(parts[s].lse[lse_idx], s);
          if (s != merge.arg_max()) rest += w[s];
        }
        const float inv_sum = LseMerge<float>::Normalizer(rest);
        for (int s = 0; s < num_parts; ++s) w[s] *= inv_sum;
        // Part 0 is folded in first because it may alias o_dst: that pass reads and writes the
        // same element only. Zero-weight parts are skipped, so a -inf part's O is never read.
        const float* o0 = parts[0].o + o_off;
        if (w[0] != 0.0f) {
          for (int d = 0; d < head_dim; ++d) o_dst[d] = w[0] * o0[d];
        } else {
          for (int d = 0; d < head_dim; ++d) o_dst[d] = 0.0f;
        }
        for (int s = 1; s < num_parts; ++s) {
          if (w[s] == 0.0f) continue;
          const float* o_s = parts[s].o + o_off;
          for (int d = 0; d < head_dim; ++d) o_dst[d] += w[s] * o_s[d];
        }
        lse_out[lse_idx] = merge.Lse(rest);
      }
    }
  };
  const int64_t num_items = (rows + kMergeRowsPerItem - 1) / kMergeRowsPerItem;
  if (pool != nullptr) {
    pool->ParallelFor(num_items, merge_rows);
  } else {
    for (int64_t i = 0; i < num_items; ++i) merge_rows(i);
  }
  return absl::OkStatus();
}

absl::Status MergeInto(const AttentionShape& shape, int64_t rows, float* o_acc, float* lse_acc,
                       const float* o, const float* lse, ThreadPool* pool) {
  const PartialView parts[2] = {{o_acc, lse_acc}, {o, lse}};
  return MergePartials(shape, rows, parts, o_acc, lse_acc, pool);
}

}  // namespace cpfill::attention
