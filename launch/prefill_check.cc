#include "launch/prefill_check.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "base/status.h"
#include "parallel/self_communicator.h"
#include "runtime/cpu/cpu_backend.h"

namespace cpfill::launch {

absl::StatusOr<PrefillCheck> CheckPrefillOnOneRank(
    const runtime::ModelConfig& config, runtime::ModelWeights weights,
    const std::vector<runtime::PrefillRequest>& batch,
    const std::vector<runtime::SequenceOutput>& out, runtime::PrefillOptions options, bool bf16,
    double tolerance) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  options.threads = 0;  // every core: the other ranks wait
  options.kv_memory_fraction = 0;
  options.kv_capacity_tokens = runtime::KvTokensForBatch(batch, 1, options.kv_block_tokens);
  CPFILL_ASSIGN_OR_RETURN(
      auto model, runtime::cpu::CreateCpuModel(config, std::move(weights), tp, cp, world, options));
  CPFILL_ASSIGN_OR_RETURN(std::vector<runtime::SequenceOutput> ref,
                          model->Prefill(batch, nullptr, nullptr));
  CPFILL_CHECK_INTERNAL(ref.size() == out.size(), ref.size(), " vs ", out.size());
  PrefillCheck c;
  double scale = 0;
  for (size_t s = 0; s < out.size(); ++s) {
    for (size_t i = 0; i < out[s].logits.size(); ++i) {
      const double d = std::fabs(double(out[s].logits[i]) - ref[s].logits[i]);
      c.max_abs_diff = std::isnan(d) ? INFINITY : std::max(c.max_abs_diff, d);
      scale = std::max(scale, std::fabs(double(ref[s].logits[i])));
    }
  }
  for (size_t s = 0; s < out.size(); ++s) {
    if (out[s].first_token == ref[s].first_token) continue;
    ++c.token_mismatches;
    std::vector<float> top = ref[s].logits;
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
    c.near_ties += bf16 && top[0] - top[1] <= 2 * c.max_abs_diff;
  }
  c.allowed = bf16 ? tolerance * std::max(1.0, scale) : tolerance;
  c.pass = c.max_abs_diff <= c.allowed && c.token_mismatches == c.near_ties;
  return c;
}

}  // namespace cpfill::launch
