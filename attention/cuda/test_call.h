// cpfill/attention/cuda/test_call.h — for the host-side tests of the CUDA backend's rules (the
// key split, the Hopper kernel's key tile): a call's arguments over host slices, no device
// memory. Test code only.
//
//   const Call c = MakeCall(8, 1, {{256, 4352}});   // 256 queries after 4096 keys, causal
//   PlanKeySplit(c.args, sms);
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "attention/cuda/attention_cuda.h"

namespace cpfill::attention::cuda::internal {

// args.slices points into slices: move a Call, do not copy it.
struct Call {
  std::vector<SequenceSlice> slices;
  CudaAttentionArgs args;
};

// `seqs` of (queries, keys): each sequence's queries and keys back to back.
inline Call MakeCall(int heads, int kv_heads, const std::vector<std::pair<int64_t, int64_t>>& seqs,
                     bool causal = true, int head_dim = 128) {
  Call c;
  int64_t q = 0, kv = 0;
  for (auto [nq, nk] : seqs) {
    c.slices.push_back({.q_begin = q, .q_len = nq, .kv_begin = kv, .kv_len = nk});
    q += nq;
    kv += nk;
  }
  c.args.shape = {.num_heads = heads,
                  .num_kv_heads = kv_heads,
                  .head_dim = head_dim,
                  .softmax_scale = 0.1f,
                  .causal = causal};
  c.args.q_tokens = q;
  c.args.kv_tokens = kv;
  c.args.slices = c.slices.data();
  c.args.num_slices = static_cast<int64_t>(c.slices.size());
  return c;
}

}  // namespace cpfill::attention::cuda::internal
