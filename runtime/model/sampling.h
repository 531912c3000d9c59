// cpfill/runtime/model/sampling.h — choosing the next token from the last position's logits:
// greedy, or seeded sampling with temperature, top-k and top-p (nucleus), as OpenAI/vLLM clients
// ask for it; and the log-probabilities a response reports.
//
// Sampling is a pure function of (logits, params, step): a Gumbel-max draw whose noise is
// counter-based on (seed, step, token id) (sampling_draw.h), so a request with a seed generates
// the same tokens on any run, batch composition or rank layout, and the device's draw
// (cuda/token_draw.h, LlamaModel's TokenDraw) picks what SampleToken picks from the same logits.
//
//   SamplingParams p{.temperature = 0.8, .top_p = 0.95, .seed = 42};
//   CPFILL_RETURN_IF_ERROR(ValidateSampling(p, vocab));
//   SampledToken t = SampleToken(logits, p, /*step=*/0);   // t.id, t.logprob, t.top
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace cpfill::runtime {

struct SamplingParams {
  double temperature = 0;  // 0: greedy (the argmax; the lowest id on a tie)
  int top_k = 0;           // keep the k most likely tokens; 0: all
  double top_p = 1.0;      // keep the most likely tokens whose probability sums to top_p
  uint64_t seed = 0;
  int logprobs = 0;  // also report the top `logprobs` tokens' log-probabilities
};

// InvalidArgument naming the field: temperature outside [0, 100], top_k < 0, top_p outside
// (0, 1], logprobs outside [0, 20] or above the vocabulary.
absl::Status ValidateSampling(const SamplingParams& p, int64_t vocab);

struct SampledToken {
  int32_t id = -1;
  // Of `id` under the model's distribution (the log-softmax of the logits), when the params ask
  // for logprobs (> 0); else 0, not computed.
  double logprob = 0;
  std::vector<std::pair<int32_t, double>> top;  // the params' top `logprobs`, most likely first
};

// A token drawn where the logits are (on the GPU, on the CP rank that holds the sequence's last
// position), so that only its id travels: `params` at generation step `step`, as SampleToken
// would draw it. Never with logprobs (they need the logits on the host).
struct TokenDraw {
  SamplingParams params;
  uint64_t step = 0;
};

// The next token from `logits` (the whole vocabulary) at generation step `step`. Log-probabilities
// are the model's (temperature 1, nothing cut), as vLLM reports them by default.
SampledToken SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t step);

}  // namespace cpfill::runtime
