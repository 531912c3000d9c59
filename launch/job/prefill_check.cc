#include "launch/job/prefill_check.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "base/status.h"
#include "parallel/self_communicator.h"
#include "runtime/model/cpu/cpu_backend.h"

namespace cpfill::launch {

absl::StatusOr<PrefillCheck> CheckPrefillOnOneRank(
    const runtime::ModelConfig& config, runtime::ModelWeights weights,
    const std::vector<runtime::PrefillRequest>& batch,
    const std::vector<runtime::SequenceOutput>& out, runtime::StepOptions options, bool bf16,
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

namespace {

// True when `token` is the argmax of `logits` or within `tie` of it.
bool Agrees(const std::vector<float>& logits, int32_t token, double tie, bool* near_tie) {
  const float max = *std::max_element(logits.begin(), logits.end());
  *near_tie = logits[token] != max && max - logits[token] <= tie;
  return logits[token] == max || *near_tie;
}

}  // namespace

absl::StatusOr<GenerationCheck> CheckGenerationOnOneRank(
    const runtime::ModelConfig& config, runtime::ModelWeights weights,
    const std::vector<runtime::PrefillRequest>& prompts,
    const std::vector<runtime::SequenceOutput>& first,
    const std::vector<std::vector<int32_t>>& generated, runtime::StepOptions options, bool bf16,
    double tolerance) {
  CPFILL_CHECK_INTERNAL(prompts.size() == generated.size() && prompts.size() == first.size(),
                        "sizes differ");
  GenerationCheck c;
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  options.threads = 0;
  options.kv_memory_fraction = 0;
  options.kv_capacity_tokens = options.kv_block_tokens;
  for (size_t s = 0; s < prompts.size(); ++s) {
    options.kv_capacity_tokens += prompts[s].tokens.size() + generated[s].size();
  }
  CPFILL_ASSIGN_OR_RETURN(
      auto model, runtime::cpu::CreateCpuModel(config, std::move(weights), tp, cp, world, options));
  // The prompts' logits first: their error bounds what a bf16 near tie is.
  std::vector<std::vector<runtime::SequenceOutput>> after_prompt;
  double scale = 0;
  for (size_t s = 0; s < prompts.size(); ++s) {
    CPFILL_ASSIGN_OR_RETURN(
        after_prompt.emplace_back(),
        model->Prefill({{.tokens = prompts[s].tokens, .session = "check-" + std::to_string(s)}},
                       nullptr, nullptr));
    const std::vector<float>& ref = after_prompt.back()[0].logits;
    for (size_t i = 0; i < ref.size() && i < first[s].logits.size(); ++i) {
      const double d = std::fabs(double(first[s].logits[i]) - ref[i]);
      c.first.max_abs_diff = std::isnan(d) ? INFINITY : std::max(c.first.max_abs_diff, d);
      scale = std::max(scale, std::fabs(double(ref[i])));
    }
  }
  c.first.allowed = bf16 ? tolerance * std::max(1.0, scale) : tolerance;
  c.first.pass = c.first.max_abs_diff <= c.first.allowed;
  // A token decided by bf16 noise: the reference's top two within twice the prompts' error.
  const double tie = bf16 ? 2 * c.first.max_abs_diff : tolerance;
  for (size_t s = 0; s < prompts.size(); ++s) {
    const std::string session = "check-" + std::to_string(s);
    std::vector<runtime::SequenceOutput> out = std::move(after_prompt[s]);
    for (size_t i = 0; i < generated[s].size(); ++i) {
      if (i > 0) {
        CPFILL_ASSIGN_OR_RETURN(
            out, model->Decode({{.tokens = {generated[s][i - 1]}, .session = session}},
                               static_cast<int64_t>(i), nullptr));
      }
      bool near_tie = false;
      ++c.tokens;
      if (!Agrees(out[0].logits, generated[s][i], tie, &near_tie)) ++c.mismatches;
      c.near_ties += near_tie;
      if (i == 0 && generated[s][0] != out[0].first_token) ++c.first.token_mismatches;
    }
    CPFILL_RETURN_IF_ERROR(model->EndSession(session));
  }
  c.pass = c.first.pass && c.mismatches == 0;
  return c;
}

}  // namespace cpfill::launch
