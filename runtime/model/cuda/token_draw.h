// cpfill/runtime/model/cuda/token_draw.h — the next token drawn on the GPU from the LM head's
// logits, so a decode step moves token ids to the host instead of every sequence's whole vocabulary
// of logits (Llama 3: 128K floats, 0.5 MB a sequence).
//
// The draw is SampleToken's (runtime/model/sampling.h) on the same logits: greedy is the argmax
// (the lowest id on a tie); otherwise the kept tokens (top-k, then top-p's nucleus at the
// temperature, ties by lower id) are found by radix selection over the logits' bits, and the
// Gumbel-max draw of sampling_draw.h picks among them. The nucleus's mass is summed in 2^-52
// fixed point (an order-free, repeatable sum), so a draw can differ from the host's only when
// top_p lies within about 1e-11 of a cumulative probability.
//
//   DeviceTokenDraw d{.scale = 1 / temperature, .top_p = 0.9, .key = DrawKey(seed, step)};
//   CPFILL_RETURN_IF_ERROR(DrawTokens(logits, rows, vocab, 1, draws_dev, n, ids_dev, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace cpfill::runtime::cuda {

// One row's draw, as the kernel reads it.
struct DeviceTokenDraw {
  double scale = 0;   // 1 / temperature; 0: greedy
  double top_p = 1;   // >= 1: no nucleus
  int64_t top_k = 0;  // <= 0: no cut (1 is greedy)
  uint64_t key = 0;   // DrawKey(seed, step)
  int64_t row = 0;    // the row of `logits` it draws from
};

// ids[i] (device) = the token draws[i] (device) picks from its row of `logits` (fp32, device):
// the vocabulary in `slices` parts of `slice_vocab` ids (a TP group's all-gathered slices), part s
// of row r at logits + (s * rows + r) * slice_vocab. One block per draw; never synchronizes.
absl::Status DrawTokens(const float* logits, int64_t rows, int64_t slice_vocab, int slices,
                        const DeviceTokenDraw* draws, int n, int32_t* ids, cudaStream_t stream);

}  // namespace cpfill::runtime::cuda
