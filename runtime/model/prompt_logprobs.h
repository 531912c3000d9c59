// cpfill/runtime/model/prompt_logprobs.h — the log-probability of every prompt token under the
// model (OpenAI's echo with logprobs, perplexity), for the requests that ask
// (PrefillRequest::prompt_logprobs) and only those.
//
// Every rank holds its CP share of a sequence's positions and its TP slice of the vocabulary.
// Position p's logits score token p + 1. Each rank computes, per local position of a request
// that asks, a partial log-softmax over its slice: the slice's max, the sum of exp(logit - max),
// the next token's logit if the slice holds it, and the slice's top k. World rank 0 gathers the
// partials (a few doubles a position, never a row of logits) and merges the slices:
//   lse = M + log(sum_r s_r exp(m_r - M)),  logprob = logit(target) - lse.
//
//   std::vector<double> mine;
//   AppendSliceScores(row_logits, tp_rank * V, seq, pos, target, k, &mine);   // every rank
//   ... gathered to world rank 0 ...
//   CPFILL_RETURN_IF_ERROR(MergeSliceScores(all, batch, cached, &outputs));  // world rank 0
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill::runtime {

// Doubles a record of sequence asking for top `k`: [seq, position, max, sum_exp, target logit
// (-inf when this slice lacks the target), k x (token id, logit)] (ids are exact in a double).
inline constexpr int64_t SliceScoreWords(int k) { return 5 + 2 * int64_t{k}; }

// Appends the record of one position: `logits` is this rank's slice of the row, whose first
// entry is vocabulary id `vocab_offset`; `target` the next prompt token (a global id).
void AppendSliceScores(std::span<const float> logits, int64_t vocab_offset, int seq,
                       int64_t position, int32_t target, int k, std::vector<double>* out);

// World rank 0: merges every rank's records (one after another, in any order) into
// (*out)[seq].prompt_logprobs, entry i for position cached[seq] + i (the request's token i + 1).
// `batch` gives each sequence's k and tokens. Internal for a record that names a sequence that
// did not ask or a position outside it, or a position no slice scored its target in.
absl::Status MergeSliceScores(std::span<const double> records,
                              const std::vector<PrefillRequest>& batch,
                              const std::vector<int64_t>& cached, std::vector<SequenceOutput>* out);

}  // namespace cpfill::runtime
