#include "parallel/gather_outputs.h"

#include <algorithm>
#include <cmath>

#include "base/status.h"

namespace cpfill::parallel {

absl::Status GatherAttentionOutputs(Communicator& world, const sharding::ShardPlan& plan,
                                    int tp_rank, int tp_size, int cp_rank, int num_heads,
                                    int head_dim, const float* o, const float* lse,
                                    std::vector<float>* o_all, std::vector<float>* lse_all) {
  CPFILL_CHECK_ARG(tp_size >= 1 && num_heads % tp_size == 0, "heads ", num_heads,
                   " do not divide by TP ", tp_size);
  const int n = world.size(), hq = num_heads / tp_size, d = head_dim;
  // Step 1: who is where: (tp_rank, cp_rank) of every world rank.
  int32_t me[2] = {tp_rank, cp_rank};
  std::vector<int32_t> who(2 * n);
  CPFILL_RETURN_IF_ERROR(world.AllGather(me, sizeof(me), who.data()));

  // Step 2: every rank sends [O | LSE] of its shard to rank 0.
  const sharding::LocalLayout mine = sharding::MakeLocalLayout(plan, cp_rank);
  std::vector<float> block(mine.q_rows() * hq * (d + 1));
  std::copy_n(o, mine.q_rows() * hq * d, block.begin());
  std::copy_n(lse, mine.q_rows() * hq, block.begin() + mine.q_rows() * hq * d);
  std::vector<size_t> send_bytes(n, 0), send_off(n, 0), recv_bytes(n, 0), recv_off(n, 0);
  send_bytes[0] = block.size() * sizeof(float);
  std::vector<sharding::LocalLayout> layouts;
  size_t total = 0;
  if (world.rank() == 0) {
    for (int p = 0; p < n; ++p) {
      layouts.push_back(sharding::MakeLocalLayout(plan, who[2 * p + 1]));
      recv_off[p] = total;
      recv_bytes[p] = layouts.back().q_rows() * hq * (d + 1) * sizeof(float);
      total += recv_bytes[p];
    }
  }
  std::vector<float> recv(total / sizeof(float));
  CPFILL_RETURN_IF_ERROR(
      world.AllToAll(block.data(), send_bytes, send_off, recv.data(), recv_bytes, recv_off));
  if (world.rank() != 0) return absl::OkStatus();

  // Step 3: place each shard's rows at their global token index, its heads at their slot.
  std::vector<int64_t> seq_offset;
  int64_t total_new = 0;
  for (const auto& s : plan.sequences) {
    seq_offset.push_back(total_new);
    total_new += s.new_tokens;
  }
  o_all->assign(total_new * num_heads * d, std::nanf(""));  // a row nobody sent stays NaN
  lse_all->assign(total_new * num_heads, std::nanf(""));
  for (int p = 0; p < n; ++p) {
    const int head0 = who[2 * p] * hq;
    const sharding::LocalLayout& layout = layouts[p];
    const float* bo = recv.data() + recv_off[p] / sizeof(float);
    const float* bl = bo + layout.q_rows() * hq * d;
    for (int s = 0; s < plan.num_sequences(); ++s) {
      for (int64_t i = 0; i < layout.q_len[s]; ++i) {
        const int64_t local = layout.q_offset[s] + i;
        const int64_t global =
            seq_offset[s] + layout.q_positions[local] - plan.sequences[s].cached_tokens;
        for (int h = 0; h < hq; ++h) {
          std::copy_n(bo + (local * hq + h) * d, d,
                      o_all->data() + (global * num_heads + head0 + h) * d);
          (*lse_all)[global * num_heads + head0 + h] = bl[local * hq + h];
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
