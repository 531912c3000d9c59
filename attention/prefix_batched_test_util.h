// cpfill/attention/prefix_batched_test_util.h — test-only: a random KV tree (a root prefix,
// groups under it with prefixes of their own, sequences with their own suffixes and queries) as
// one attention problem and its levels, and its fp64 reference: each sequence's attention over
// its concatenated keys, computed apart. Shared by the CPU and CUDA tests of prefix_batched.h.
//
//   TreeProblem t = MakeTreeProblem(shape, {.root = 300, .groups = {{50, {{20, 1}, {7, 7}}}}}, 3);
//   ... run t.Levels() into t.pb.o / t.pb.lse ...
//   ExpectOutputsMatch(shape, t.pb.q_tokens, o, lse, t.ref_o, t.ref_lse);
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "attention/attention_test_util.h"
#include "attention/prefix_batched.h"

namespace cpfill::attention::testing {

struct TreeSpec {
  struct Sequence {
    int64_t suffix = 0;   // its own keys (the queries are its last `queries` of them)
    int64_t queries = 0;  // 1: a decode step
  };
  struct Group {
    int64_t prefix = 0;  // shared by the group's sequences, after the root (0: none)
    std::vector<Sequence> sequences;
  };
  int64_t root = 0;
  std::vector<Group> groups;
};

struct TreeProblem {
  Problem pb;                                      // q, k, v, positions; pb.slices unused
  std::vector<std::vector<SequenceSlice>> levels;  // root, group prefixes, suffixes
  std::vector<double> ref_o, ref_lse;

  std::vector<std::span<const SequenceSlice>> Levels() const {
    return {levels.begin(), levels.end()};
  }
};

// Key rows: the root, every group's prefix, then every sequence's suffix. Query rows: every
// sequence's, in order. Positions are each sequence's own: root, group prefix, suffix.
// `round` (when set) is applied to every input first: the CUDA test rounds through bf16, so the
// reference sees the numbers the device sees.
inline TreeProblem MakeTreeProblem(const AttentionShape& shape, const TreeSpec& spec, uint64_t seed,
                                   float (*round)(float) = nullptr) {
  int64_t q_tokens = 0, kv_tokens = spec.root;
  for (const auto& g : spec.groups) {
    kv_tokens += g.prefix;
    for (const auto& s : g.sequences) {
      kv_tokens += s.suffix;
      q_tokens += s.queries;
    }
  }
  TreeProblem t;
  t.pb = MakeProblem(shape, q_tokens, kv_tokens, seed);
  if (round != nullptr) {
    for (std::vector<float>* x : {&t.pb.q, &t.pb.k, &t.pb.v}) {
      for (float& e : *x) e = round(e);
    }
  }
  t.levels.resize(3);
  t.levels[0].push_back({.q_begin = 0, .q_len = q_tokens, .kv_begin = 0, .kv_len = spec.root});
  for (int64_t i = 0; i < spec.root; ++i) t.pb.k_pos[i] = static_cast<int32_t>(i);
  int64_t kv = spec.root, q = 0;
  std::vector<int64_t> group_kv;
  for (const auto& g : spec.groups) {
    group_kv.push_back(kv);
    for (int64_t i = 0; i < g.prefix; ++i) t.pb.k_pos[kv + i] = static_cast<int32_t>(spec.root + i);
    kv += g.prefix;
  }
  t.ref_o.assign(t.pb.o.size(), 0.0);
  t.ref_lse.assign(t.pb.lse.size(), 0.0);
  for (size_t gi = 0; gi < spec.groups.size(); ++gi) {
    const TreeSpec::Group& g = spec.groups[gi];
    int64_t group_q = 0;
    for (const auto& s : g.sequences) group_q += s.queries;
    t.levels[1].push_back(
        {.q_begin = q, .q_len = group_q, .kv_begin = group_kv[gi], .kv_len = g.prefix});
    for (const auto& s : g.sequences) {
      const int64_t base = spec.root + g.prefix;
      for (int64_t i = 0; i < s.suffix; ++i) t.pb.k_pos[kv + i] = static_cast<int32_t>(base + i);
      for (int64_t i = 0; i < s.queries; ++i) {
        t.pb.q_pos[q + i] = static_cast<int32_t>(base + s.suffix - s.queries + i);
      }
      t.levels[2].push_back({.q_begin = q, .q_len = s.queries, .kv_begin = kv, .kv_len = s.suffix});
      // The reference: this sequence alone over its concatenated keys.
      Problem one = MakeProblem(shape, s.queries, spec.root + g.prefix + s.suffix, 0);
      const int64_t q_row = shape.num_heads * shape.head_dim;
      const int64_t kv_row = shape.num_kv_heads * shape.head_dim;
      std::copy(t.pb.q.begin() + q * q_row, t.pb.q.begin() + (q + s.queries) * q_row,
                one.q.begin());
      std::copy(t.pb.q_pos.begin() + q, t.pb.q_pos.begin() + q + s.queries, one.q_pos.begin());
      int64_t at = 0;
      for (const auto& [begin, len] :
           {std::pair{int64_t{0}, spec.root}, std::pair{group_kv[gi], g.prefix},
            std::pair{kv, s.suffix}}) {
        std::copy(t.pb.k.begin() + begin * kv_row, t.pb.k.begin() + (begin + len) * kv_row,
                  one.k.begin() + at * kv_row);
        std::copy(t.pb.v.begin() + begin * kv_row, t.pb.v.begin() + (begin + len) * kv_row,
                  one.v.begin() + at * kv_row);
        std::copy(t.pb.k_pos.begin() + begin, t.pb.k_pos.begin() + begin + len,
                  one.k_pos.begin() + at);
        at += len;
      }
      one.slices = {{.q_begin = 0, .q_len = s.queries, .kv_begin = 0, .kv_len = at}};
      std::vector<double> o, lse;
      ReferenceAttention(one.Params(), &o, &lse);
      std::copy(o.begin(), o.end(), t.ref_o.begin() + q * q_row);
      std::copy(lse.begin(), lse.end(), t.ref_lse.begin() + q * shape.num_heads);
      kv += s.suffix;
      q += s.queries;
    }
  }
  return t;
}

// A decode step over a KV cache's blocks as a ring step sees it (FindSharedBlocks' input): one
// query row per sequence every `q_stride` rows (the rows between are padding, position -1, in no
// slice, as pass-Q messages had until they carried their source's queries only), each sequence's
// keys the same `shared_blocks` blocks of prefix rows then `own_rows` of its own, in a shuffled
// block pool (NaN in every row no sequence holds). The first `sharing` sequences hold the prefix in
// the same blocks (forks of one prompt); the others in copies of their own (prefilled apart): same
// keys, different block ids.
struct SharedBlocksSpec {
  int block_tokens = 16;
  int64_t shared_blocks = 3;
  std::vector<int64_t> own_rows;  // one per sequence
  int sharing = 0;
  // The last `nested_sharing` of the `sharing` sequences also share the `nested_blocks` blocks
  // after the prefix (a document under a system prompt: a tree of three levels); those rows are
  // part of their own_rows.
  int64_t nested_blocks = 0;
  int nested_sharing = 0;
  int64_t q_stride = 1;
  // Query rows per sequence, back to back, at positions up to its key count (one: a decode
  // step; more: a prefill of the sequence's last rows, as over cached rows). Sequence i's rows
  // start at i * q_stride * queries.
  int64_t queries = 1;
};

struct SharedBlocksProblem {
  Problem pb;  // the step's queries and positions; k/v each sequence's rows contiguous, at its
               // kv_begin; slices one per sequence
  std::vector<float> pool_k, pool_v;  // [blocks][block_tokens][kv_heads * head_dim]
  std::vector<int32_t> table;
  std::vector<int64_t> seq_kv_begin, seq_table_begin;
  int block_tokens = 0;
  std::vector<double> ref_o, ref_lse;

  // The pool's view; `table_memory` holds `table` where the kernel reads it, and the host copy is
  // given only when `batch` (FindSharedBlocks may group sequences).
  PagedKv Paged(const int32_t* table_memory, int64_t elem_bytes, bool batch) const {
    const int64_t row = int64_t{pb.shape.num_kv_heads} * pb.shape.head_dim;
    return {.table = table_memory,
            .block_tokens = block_tokens,
            .block_stride_bytes = block_tokens * row * elem_bytes,
            .seq_kv_begin = seq_kv_begin,
            .seq_table_begin = seq_table_begin,
            .host_table = batch ? std::span<const int32_t>(table) : std::span<const int32_t>()};
  }
};

inline SharedBlocksProblem MakeSharedBlocksProblem(const AttentionShape& shape,
                                                   const SharedBlocksSpec& spec, uint64_t seed,
                                                   float (*round)(float) = nullptr) {
  const int64_t bt = spec.block_tokens, n = static_cast<int64_t>(spec.own_rows.size());
  const int64_t prefix = spec.shared_blocks * bt;
  const int64_t nested = spec.nested_blocks * bt;
  const auto nests = [&](int64_t i) {
    return i < spec.sharing && i >= spec.sharing - spec.nested_sharing;
  };
  int64_t kv_tokens = 0;
  for (int64_t own : spec.own_rows) kv_tokens += prefix + own;
  SharedBlocksProblem t;
  t.block_tokens = spec.block_tokens;
  t.pb = MakeProblem(shape, n * spec.q_stride * spec.queries, kv_tokens, seed);
  if (round != nullptr) {
    for (std::vector<float>* x : {&t.pb.q, &t.pb.k, &t.pb.v}) {
      for (float& e : *x) e = round(e);
    }
  }
  const int64_t row = int64_t{shape.num_kv_heads} * shape.head_dim;
  // The blocks: the shared prefix's and the nested part's once, then every sequence's own (and
  // its prefix copy).
  int64_t blocks = spec.shared_blocks + spec.nested_blocks + 2;  // two spare blocks nobody holds
  for (int64_t i = 0; i < n; ++i) {
    blocks += (i < spec.sharing ? 0 : spec.shared_blocks) + (spec.own_rows[i] + bt - 1) / bt -
              (nests(i) ? spec.nested_blocks : 0);
  }
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  t.pool_k.assign(blocks * bt * row, kNaN);
  t.pool_v.assign(t.pool_k.size(), kNaN);
  size_t next = 0;
  const std::vector<int32_t> shared_ids(ids.begin(), ids.begin() + spec.shared_blocks);
  next += spec.shared_blocks;
  const std::vector<int32_t> nested_ids(ids.begin() + next,
                                        ids.begin() + next + spec.nested_blocks);
  next += spec.nested_blocks;
  int64_t nested_kv = -1;  // the first nested sharer's first key row
  std::fill(t.pb.q_pos.begin(), t.pb.q_pos.end(), kPadPosition);
  t.pb.slices.clear();
  int64_t kv = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = prefix + spec.own_rows[i];
    // The prefix's keys are the first sequence's rows: every sequence repeats them.
    if (i > 0) {
      std::copy_n(t.pb.k.begin(), prefix * row, t.pb.k.begin() + kv * row);
      std::copy_n(t.pb.v.begin(), prefix * row, t.pb.v.begin() + kv * row);
    }
    // And the nested part's, the first nested sharer's.
    if (nests(i) && nested_kv < 0) nested_kv = kv;
    if (nests(i) && nested_kv != kv) {
      const int64_t from = (nested_kv + prefix) * row, to = (kv + prefix) * row;
      std::copy_n(t.pb.k.begin() + from, nested * row, t.pb.k.begin() + to);
      std::copy_n(t.pb.v.begin() + from, nested * row, t.pb.v.begin() + to);
    }
    for (int64_t r = 0; r < len; ++r) t.pb.k_pos[kv + r] = static_cast<int32_t>(r);
    const int64_t q_begin = i * spec.q_stride * spec.queries;
    for (int64_t j = 0; j < spec.queries; ++j) {
      t.pb.q_pos[q_begin + j] = static_cast<int32_t>(len - spec.queries + 1 + j);
    }
    t.pb.slices.push_back(
        {.q_begin = q_begin, .q_len = spec.queries, .kv_begin = kv, .kv_len = len});
    t.seq_kv_begin.push_back(kv);
    t.seq_table_begin.push_back(static_cast<int64_t>(t.table.size()));
    for (int64_t r = 0; r < len; r += bt) {
      if (r < prefix && i < spec.sharing) {
        t.table.push_back(shared_ids[r / bt]);
      } else if (r >= prefix && r < prefix + nested && nests(i)) {
        t.table.push_back(nested_ids[(r - prefix) / bt]);
      } else {
        t.table.push_back(ids[next++]);
      }
      const int64_t rows = std::min(bt, len - r);
      std::copy_n(t.pb.k.begin() + (kv + r) * row, rows * row,
                  t.pool_k.begin() + t.table.back() * bt * row);
      std::copy_n(t.pb.v.begin() + (kv + r) * row, rows * row,
                  t.pool_v.begin() + t.table.back() * bt * row);
    }
    kv += len;
  }
  ReferenceAttention(t.pb.Params(), &t.ref_o, &t.ref_lse);
  return t;
}

}  // namespace cpfill::attention::testing
