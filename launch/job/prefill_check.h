// cpfill/launch/job/prefill_check.h — a distributed prefill's last-position logits against one rank
// running the same batch on the fp32 CPU model.
//
//   CPFILL_ASSIGN_OR_RETURN(PrefillCheck c, CheckPrefillOnOneRank(config, weights, batch, out,
//                                                                 options, bf16, 3e-2));
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "runtime/model/model_config.h"
#include "runtime/model/prefill_batch.h"
#include "runtime/model/weights.h"

namespace cpfill::launch {

struct PrefillCheck {
  double max_abs_diff = 0;  // max |logit - logit_1rank| over every sequence
  double allowed = 0;       // the bound it was held to
  int token_mismatches = 0, near_ties = 0;
  bool pass = false;
};

// Runs on one process (world rank 0): prefills `batch` on a single-rank CPU model with `weights`
// (the whole, TP 1) and compares with `out`. fp32 (`bf16` false): every logit within `tolerance`
// and every first token equal. bf16: within `tolerance` relative to the logits' scale, and a
// first token may differ only where the reference's top two logits are closer than twice the
// error measured (a near tie).
absl::StatusOr<PrefillCheck> CheckPrefillOnOneRank(
    const runtime::ModelConfig& config, runtime::ModelWeights weights,
    const std::vector<runtime::PrefillRequest>& batch,
    const std::vector<runtime::SequenceOutput>& out, runtime::StepOptions options, bool bf16,
    double tolerance);

// A distributed greedy generation against one rank teacher-forced on the same tokens: the
// reference prefills each prompt, then decodes the tokens the run generated, one step each,
// and every generated token must be the reference's argmax at its step, or a near tie there (the
// reference's logit of it within `tie` of its max). Also checks the first-token logits as
// CheckPrefillOnOneRank does. `generated[s]` are sequence s's tokens, first token first.
struct GenerationCheck {
  PrefillCheck first;  // the prefill's logits
  int64_t tokens = 0;  // generated tokens compared
  int mismatches = 0, near_ties = 0;
  bool pass = false;
};
absl::StatusOr<GenerationCheck> CheckGenerationOnOneRank(
    const runtime::ModelConfig& config, runtime::ModelWeights weights,
    const std::vector<runtime::PrefillRequest>& prompts,
    const std::vector<runtime::SequenceOutput>& first,
    const std::vector<std::vector<int32_t>>& generated, runtime::StepOptions options, bool bf16,
    double tolerance);

}  // namespace cpfill::launch
