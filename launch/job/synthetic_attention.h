// cpfill/launch/job/synthetic_attention.h — deterministic attention inputs for a fused batch.
//
// Every element of Q, K and V is a pure function of (seed, tensor, sequence, position, head,
// dim) (base/random.h), so each rank generates exactly its shard — its tokens, its TP heads —
// and a single-rank reference generates the whole batch, bit-identical, without moving data.
//
//   SyntheticAttention batch{.sequences = seqs, .num_heads = 16, .num_kv_heads = 1,
//                            .head_dim = 128, .seed = 1};
//   batch.FillLocal(layout, heads_slice, q.data(), k.data(), v.data());  // this rank's shard
//   batch.FillGlobal(q_all.data(), k_all.data(), v_all.data());          // whole batch
#pragma once

#include <cstdint>
#include <vector>

#include "sharding/plan.h"

namespace cpfill::launch {

// The heads one TP rank holds: query heads [q_begin, q_begin + q_count) and KV heads
// [kv_begin, kv_begin + kv_count) of the model.
struct HeadSlice {
  int q_begin = 0, q_count = 0;
  int kv_begin = 0, kv_count = 0;
  // TP rank `tp_rank` of `tp_size` takes an equal contiguous share of both.
  static HeadSlice ForTpRank(int num_heads, int num_kv_heads, int tp_rank, int tp_size) {
    return {num_heads / tp_size * tp_rank, num_heads / tp_size, num_kv_heads / tp_size * tp_rank,
            num_kv_heads / tp_size};
  }
};

struct SyntheticAttention {
  std::vector<sharding::SequenceRequest> sequences;
  int num_heads = 0;  // model totals; a HeadSlice picks a rank's share
  int num_kv_heads = 0;
  int head_dim = 0;
  uint64_t seed = 1;

  float Q(int seq, int64_t pos, int head, int d) const;
  float K(int seq, int64_t pos, int kv_head, int d) const;
  float V(int seq, int64_t pos, int kv_head, int d) const;

  // A rank's shard in its local layout: q [layout.q_rows, slice.q_count, D],
  // k/v [layout.kv_rows, slice.kv_count, D].
  void FillLocal(const sharding::LocalLayout& layout, const HeadSlice& slice, float* q, float* k,
                 float* v) const;
  // The whole batch in global token order (q: new tokens of every sequence in turn; k/v: cached
  // then new tokens of every sequence in turn), all heads.
  void FillGlobal(float* q, float* k, float* v) const;

  int64_t total_new_tokens() const;
  int64_t total_kv_tokens() const;
};

}  // namespace cpfill::launch
