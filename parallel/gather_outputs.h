// cpfill/parallel/gather_outputs.h — every rank's attention output shard, assembled on world
// rank 0 in global token order. For checks (`--check`, the multi-rank tests) and `--save`; not on
// any hot path.
//
//   std::vector<float> o_all, lse_all;   // filled on world rank 0 only
//   CPFILL_RETURN_IF_ERROR(GatherAttentionOutputs(*grid.world, plan, grid.tp_rank, grid.tp_size,
//                                                 grid.cp_rank, heads, head_dim, o, lse,
//                                                 &o_all, &lse_all));
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "parallel/communicator.h"
#include "sharding/plan.h"

namespace cpfill::parallel {

// o/lse: this rank's outputs in MakeLocalLayout(plan, cp_rank) order for its TP share of the
// heads (num_heads / tp_size contiguous heads starting at tp_rank * that). On world rank 0:
// o_all [total new tokens, num_heads, head_dim], lse_all [total new tokens, num_heads], where
// sequence i's new tokens follow sequence i-1's. Collective over `world`.
absl::Status GatherAttentionOutputs(Communicator& world, const sharding::ShardPlan& plan,
                                    int tp_rank, int tp_size, int cp_rank, int num_heads,
                                    int head_dim, const float* o, const float* lse,
                                    std::vector<float>* o_all, std::vector<float>* lse_all);

}  // namespace cpfill::parallel
