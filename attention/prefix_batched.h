// cpfill/attention/prefix_batched.h — attention over a tree of shared KV: Hydragen's prefix /
// suffix decomposition, bifurcated attention's decode case, ChunkAttention's chunk-first phase. The
// model's decode and prefill steps over shared prefixes run it (runtime/serving/prefix_cache.md).
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
#include <vector>

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

// Prefix-batched attention in a paged step (runtime/serving/prefix_cache.md, "Prefix-batched
// decode" and "Prefix-batched prefill"): the step's keys are a KV cache's blocks (PagedKv with its
// host_table), and sequences forked from one prompt start with the same block ids. A run of
// consecutive slices whose tables share leading blocks becomes one root slice over the run's query
// rows (from its first row to its last: rows between that belong to no slice are padding at
// position -1 and see no key; a ring's pass-Q messages have none since they carry their source's
// queries unpadded) against the shared rows, read once through the first sequence's table; each
// member keeps its own rows after them. Those rows are searched the same way, a level deeper: a
// system prompt under several documents, each asked several questions, is a tree of three levels
// (Hydragen's hierarchical sharing), and each document is read once, under its own root.
// What a tree's levels cost where each is a kernel launch (the GPU): a step keeps its roots only
// when the K and V values they spare from being read again (key rows saved x KV heads x head dim
// x 2) reach min_saved_values plus merge_cost x the values its later levels merge (their query
// rows x heads x head dim: each level writes and merges its partial output in fp32). Otherwise
// every sequence reads its own keys, as without prefix batching. Zero (the CPU): roots always
// pay.
struct TreeCosts {
  int64_t min_saved_values = 0;
  double merge_cost = 0;
};
// Measured on an H100 (bench/RESULTS.md, 2026-11-27, bench/gpu/prefix_attention.sh): a root
// under 16M values (32 MB of bf16 K and V, about 10 µs of HBM) lost to the flat step in decode,
// and a suffix prefill's tree lost wherever it spared fewer than twice the values it merged.
inline constexpr TreeCosts kGpuTreeCosts{.min_saved_values = int64_t{16} << 20, .merge_cost = 2.0};

struct SharedBlockRule {
  // Packed (query row x query heads of a KV head) rows one read of a key tile serves: a root
  // pays when it reads the shared keys fewer times than its members would, each on its own
  // (the CUDA decode kernel: an m16 tile).
  int rows_per_read = 16;
  // Packed rows under one root at most (the decode kernel's cost grows with them); a longer run
  // is cut into several roots.
  int64_t max_root_rows = 128;
  // A root for every run of two or more sequences that share blocks, whatever the reads: a
  // gathered step's (below), where reading the shared rows once pays by itself.
  bool always_root = false;
  // Whether the step's roots pay at all (above).
  TreeCosts costs;
};

// A paged step whose slices hold more query rows than a decode step's (a prefill after cached
// rows: questions after a document, a later turn) does not read the blocks in place: its keys are
// gathered into contiguous rows for the prefill kernels, the shared blocks once
// (PlanPagedGather), and the root over them is one GEMM-shaped pass however many rows it has.
inline constexpr int64_t kMaxInPlaceQueryRows = 4;
bool GathersPagedKv(std::span<const SequenceSlice> slices);
// The rule for a step's roots: the default (decode, in place), or a root for every run of
// sequences that share blocks (gathered); either under `costs`.
SharedBlockRule RuleForStep(std::span<const SequenceSlice> slices, const TreeCosts& costs = {});

// What prefix batching did: roots run, the sequences under them, and the key rows read once for
// several sequences instead of once each (summed over calls; one head).
struct PrefixBatchCounts {
  int64_t roots = 0;
  int64_t sequences = 0;
  int64_t key_rows_saved = 0;
  PrefixBatchCounts& operator+=(const PrefixBatchCounts& o) {
    roots += o.roots;
    sequences += o.sequences;
    key_rows_saved += o.key_rows_saved;
    return *this;
  }
  PrefixBatchCounts operator-(const PrefixBatchCounts& o) const {
    return {.roots = roots - o.roots,
            .sequences = sequences - o.sequences,
            .key_rows_saved = key_rows_saved - o.key_rows_saved};
  }
};

// The call as levels (a KvTree): levels[0] holds the outermost roots and every slice under
// none, whole; each later level the roots found among the rows the members of the level before
// have past their root, and those rows not under a deeper root. No root (counts.roots == 0):
// levels is {slices}. There is always a level 0. Run level 0 as the call would have run, then
// merge each later level into it. Slices must ascend by q_begin (a ring step's do); `paged` must
// hold its host_table (else no root).
using KvLevels = std::vector<std::vector<SequenceSlice>>;
struct SharedBlockTree {
  KvLevels levels;
  PrefixBatchCounts counts;
  std::vector<size_t> outer_roots;  // which slices of levels[0] are roots
};
// `keyless`: query rows of the step that see no key here (a pass-Q message's sequences with
// none on this rank; their q ranges): a root never spans them, as it would give them its keys.
SharedBlockTree FindSharedBlocks(const AttentionShape& shape, std::span<const SequenceSlice> slices,
                                 const PagedKv& paged, const SharedBlockRule& rule = {},
                                 std::span<const SequenceSlice> keyless = {});

// A gathered step's keys: the rows its tree's slices read, each once, copied out of the blocks
// back to back; the tree's levels rewritten to read them there (`levels`, one for each of the
// tree's). A level's slices keep their query rows.
struct PagedGather {
  // Rows [0, rows) of `block`, whose positions start at the step's local key row `from_row`,
  // go to gathered rows [to_row, to_row + rows). (The CUDA gather reads this layout.)
  struct Copy {
    int32_t block = 0;
    int32_t rows = 0;
    int64_t from_row = 0;
    int64_t to_row = 0;
  };
  std::vector<Copy> copies;
  KvLevels levels;
  int64_t rows = 0;
};
// `table`: the block table in host memory (paged.host_table, or paged.table on the CPU).
PagedGather PlanPagedGather(const SharedBlockTree& tree, const PagedKv& paged,
                            std::span<const int32_t> table);

// A decode step read in place whose outer roots are wide. A GPU's decode kernel reads a root's
// keys once per `rows_per_read` packed rows (query rows x query heads of a KV head), so a root
// of more than `min_packed_rows` whose re-reads come to `min_reread_values` K and V values or
// more has its shared rows gathered once, for the prefill kernels (once per `rows_per_tile`),
// if it makes `min_tiles` (tiles x KV heads) at least; at most `max_rows` gathered rows in all
// (the other roots stay in place).
struct WideRootRule {
  int64_t min_packed_rows = 0;
  int64_t max_rows = 0;
  int64_t rows_per_read = 16;
  int64_t min_reread_values = 0;
  int64_t rows_per_tile = 128;
  int64_t min_tiles = 0;
  bool operator==(const WideRootRule&) const = default;
};
struct WideRootsPlan {
  PagedGather gathered;  // one level: the wide roots over their gathered rows; no copies: none
  KvLevels in_place;     // the tree without them, level by level
};
WideRootsPlan PlanWideRoots(const AttentionShape& shape, const SharedBlockTree& tree,
                            const PagedKv& paged, std::span<const int32_t> table,
                            const WideRootRule& rule);

}  // namespace cpfill::attention
