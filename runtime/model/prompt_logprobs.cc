#include "runtime/model/prompt_logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/status.h"

namespace cpfill::runtime {

void AppendSliceScores(std::span<const float> logits, int64_t vocab_offset, int seq,
                       int64_t position, int32_t target, int k, std::vector<double>* out) {
  double max = -std::numeric_limits<double>::infinity();
  for (const float x : logits) max = std::max(max, static_cast<double>(x));
  double sum = 0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - max);
  const int64_t local = target - vocab_offset;
  const bool held = local >= 0 && local < static_cast<int64_t>(logits.size());
  out->insert(out->end(),
              {double(seq), double(position), max, sum,
               held ? double(logits[local]) : -std::numeric_limits<double>::infinity()});
  // The slice's top k, the lower id first on a tie (as SampleToken's top logprobs).
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  const size_t kept = std::min(ids.size(), static_cast<size_t>(k));
  std::partial_sort(ids.begin(), ids.begin() + kept, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int i = 0; i < k; ++i) {
    const bool real = static_cast<size_t>(i) < kept;
    out->push_back(real ? double(vocab_offset + ids[i]) : -1.0);
    out->push_back(real ? double(logits[ids[i]]) : -std::numeric_limits<double>::infinity());
  }
}

namespace {

// One position's slices merged so far: max, sum of exp(logit - max), the target's logit, and
// the candidates for its top k.
struct Merged {
  double max = -std::numeric_limits<double>::infinity(), sum = 0;
  double target = -std::numeric_limits<double>::infinity();
  std::vector<std::pair<int32_t, double>> top;
};

bool Before(const std::pair<int32_t, double>& a, const std::pair<int32_t, double>& b) {
  return a.second > b.second || (a.second == b.second && a.first < b.first);
}

void Merge(const double* r, int k, Merged* m) {
  const double max = r[2], sum = r[3];
  // A slice with no finite logit (empty, or all -inf) adds no mass; merging it would compute
  // exp(-inf - -inf) = NaN while m->max is still -inf.
  if (max > -std::numeric_limits<double>::infinity()) {
    if (max > m->max) {
      m->sum = m->sum * std::exp(m->max - max) + sum;
      m->max = max;
    } else {
      m->sum += sum * std::exp(max - m->max);
    }
  }
  m->target = std::max(m->target, r[4]);
  for (int i = 0; i < k; ++i) {
    if (r[5 + 2 * i] >= 0) m->top.push_back({static_cast<int32_t>(r[5 + 2 * i]), r[6 + 2 * i]});
  }
  // Only the best k can survive: keeping every slice's k would hold TP x k per position (a 128K
  // prompt at TP 8, k 20: some 330 MB on world rank 0 until the merge ends).
  if (static_cast<int>(m->top.size()) > k) {
    std::partial_sort(m->top.begin(), m->top.begin() + k, m->top.end(), Before);
    m->top.resize(static_cast<size_t>(k));
  }
}

}  // namespace

absl::Status MergeSliceScores(std::span<const double> records,
                              const std::vector<PrefillRequest>& batch,
                              const std::vector<int64_t>& cached,
                              std::vector<SequenceOutput>* out) {
  std::vector<std::vector<Merged>> merged(batch.size());
  for (size_t s = 0; s < batch.size(); ++s) {
    if (batch[s].prompt_logprobs >= 0 && batch[s].tokens.size() > 1) {
      merged[s].resize(batch[s].tokens.size() - 1);
    }
  }
  for (size_t at = 0; at < records.size();) {
    const int64_t seq = static_cast<int64_t>(records[at]);
    CPFILL_CHECK_INTERNAL(
        seq >= 0 && seq < static_cast<int64_t>(batch.size()) && batch[seq].prompt_logprobs >= 0,
        "a prompt logprob record names sequence ", seq, ", which asked none");
    const int k = batch[seq].prompt_logprobs;
    const int64_t i = static_cast<int64_t>(records[at + 1]) - cached[seq];
    CPFILL_CHECK_INTERNAL(i >= 0 && i < static_cast<int64_t>(merged[seq].size()) &&
                              at + SliceScoreWords(k) <= records.size(),
                          "a prompt logprob record of sequence ", seq, " at position ",
                          records[at + 1], " is outside it");
    Merge(&records[at], k, &merged[seq][i]);
    at += SliceScoreWords(k);
  }
  for (size_t s = 0; s < batch.size(); ++s) {
    const int k = batch[s].prompt_logprobs;
    for (size_t i = 0; i < merged[s].size(); ++i) {
      Merged& m = merged[s][i];
      CPFILL_CHECK_INTERNAL(std::isfinite(m.target), "no vocabulary slice scored position ", i,
                            " of sequence ", s);
      const double lse = m.max + std::log(m.sum);
      SampledToken t{.id = batch[s].tokens[i + 1], .logprob = m.target - lse};
      std::sort(m.top.begin(), m.top.end(), Before);
      for (int j = 0; j < k && j < static_cast<int>(m.top.size()); ++j) {
        t.top.push_back({m.top[j].first, m.top[j].second - lse});
      }
      (*out)[s].prompt_logprobs.push_back(std::move(t));
    }
  }
  return absl::OkStatus();
}

}  // namespace cpfill::runtime
