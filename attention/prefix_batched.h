// cpfill/attention/prefix_batched.h — attention over a tree of shared KV: Hydragen's prefix /
// suffix decomposition, bifurcated attention's decode case, ChunkAttention's chunk-first phase
// (issue 21).
//
// When sequences share a prefix, plain attention reads the prefix's K/V once per sequence. Here
// the batch's KV is a tree of levels, each a set of slices (attention.h) whose query rows are
// disjoint:
//   - level 0: one slice per shared root prefix, over the query rows of every sequence under it,
//     against the prefix's key rows: one pass per KV head for all those queries together, so the
//     prefix is read once and the attention is GEMM-shaped (many query rows per K/V tile);
//   - deeper levels: prefixes of prefixes, each over its subgroup's query rows (Hydragen's
//     hierarchical case);
//   - the last level: each sequence's own suffix, causal, as a plain fused batch.
// A query row attends to the union of its slices' keys over the levels; the levels' partial
// results merge exactly by their log-sum-exp (attention.h MergeInto; Hydragen eq. 5), so the
// result is the attention over each sequence's concatenated keys. Positions still decide the
// mask: a prefix's keys lie before its sequences' queries, so its tiles run unmasked.
//
//   const std::span<const SequenceSlice> levels[] = {prefix_slices, suffix_slices};
//   CPFILL_RETURN_IF_ERROR(PrefixBatchedAttentionCpu(p, levels, o_part, lse_part, &pool));
#pragma once

#include <span>

#include "absl/status/status.h"
#include "attention/attention.h"
#include "base/thread_pool.h"

namespace cpfill::attention {

using KvTree = std::span<const std::span<const SequenceSlice>>;

// InvalidArgument unless `levels` is non-empty, every level is a valid slice set for `p`
// (ValidateAttentionParams with that level's slices), and no query row sees one key row in two
// levels (it would be counted twice). p.slices and p.num_slices are ignored.
absl::Status ValidateKvTree(const AttentionParams& p, KvTree levels);

// The attention of p's queries over the tree, into p.o and p.lse (every row written; a row no
// level covers gets O = 0, LSE = -inf). `o_part` and `lse_part` are scratch of p.o's and p.lse's
// sizes (unused with one level). CPU kernel (PartialAttentionCpu) per level, then MergeInto.
absl::Status PrefixBatchedAttentionCpu(const AttentionParams& p, KvTree levels, float* o_part,
                                       float* lse_part, ThreadPool* pool);

}  // namespace cpfill::attention
