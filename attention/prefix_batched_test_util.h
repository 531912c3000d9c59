// cpfill/attention/prefix_batched_test_util.h — test-only: a random KV tree (a root prefix,
// groups under it with prefixes of their own, sequences with their own suffixes and queries) as
// one attention problem and its levels, and its fp64 reference: each sequence's attention over
// its concatenated keys, computed apart. Shared by the CPU and CUDA tests of prefix_batched.h.
//
//   TreeProblem t = MakeTreeProblem(shape, {.root = 300, .groups = {{50, {{20, 1}, {7, 7}}}}}, 3);
//   ... run t.Levels() into t.pb.o / t.pb.lse ...
//   ExpectOutputsMatch(shape, t.pb.q_tokens, o, lse, t.ref_o, t.ref_lse);
#pragma once

#include <cstdint>
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

}  // namespace cpfill::attention::testing
