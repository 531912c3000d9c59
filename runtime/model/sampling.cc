#include "runtime/model/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/sampling_draw.h"

namespace cpfill::runtime {
namespace {

// Candidates sorted first for top-p: for a language model's distribution their mass almost
// always reaches top_p, so the whole vocabulary (128K for Llama 3) is sorted only when it does
// not.
constexpr size_t kNucleusFirstPass = 1024;

int32_t Argmax(std::span<const float> z) {
  return static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
}

double LogSumExp(std::span<const float> z, double scale) {
  double max = -std::numeric_limits<double>::infinity(), sum = 0;
  for (float x : z) max = std::max(max, double(x) * scale);
  if (!std::isfinite(max)) return max;
  for (float x : z) sum += std::exp(double(x) * scale - max);
  return max + std::log(sum);
}

// Token ids, most likely first (ties: lower id first), the first `n` of them sorted.
std::vector<int32_t> MostLikely(std::span<const float> z, size_t n) {
  std::vector<int32_t> ids(z.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto before = [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
  n = std::min(n, ids.size());
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), before);
  ids.resize(n);
  return ids;
}

// The candidates sampling keeps, most likely first: top_k, then the smallest prefix whose
// probability (at the temperature) reaches top_p.
std::vector<int32_t> Candidates(std::span<const float> z, const SamplingParams& p, double scale,
                                double log_z) {
  const size_t k = p.top_k > 0 ? static_cast<size_t>(p.top_k) : z.size();
  // (Every token kept draws from all: no order is needed. Sorting Llama 3's 128K logits cost
  // about 25 ms a token on an H100 host, 1.8 s a decode step of 64 samples.)
  if (p.top_p >= 1.0) return MostLikely(z, k);
  for (size_t n = std::min(k, kNucleusFirstPass);; n = k) {
    std::vector<int32_t> ids = MostLikely(z, n);
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += std::exp(double(z[ids[i]]) * scale - log_z);
      if (mass >= p.top_p) {
        ids.resize(i + 1);
        return ids;
      }
    }
    if (n == k) return ids;  // rounding left the sum just under top_p: keep them all
  }
}

// The Gumbel-max draw (sampling_draw.h) among `ids`, or among every token when `ids` is null.
int32_t Draw(std::span<const float> z, const std::vector<int32_t>* ids, double scale,
             uint64_t key) {
  int32_t best = -1;
  double best_score = -std::numeric_limits<double>::infinity();
  const auto consider = [&](int32_t id) {
    const double score = DrawScore(z[id], scale, key, id);
    if (best < 0 || score > best_score || (score == best_score && id < best)) {
      best = id;
      best_score = score;
    }
  };
  if (ids == nullptr) {
    for (size_t i = 0; i < z.size(); ++i) consider(static_cast<int32_t>(i));
  } else {
    for (int32_t id : *ids) consider(id);
  }
  return best;
}

}  // namespace

absl::Status ValidateSampling(const SamplingParams& p, int64_t vocab) {
  CPFILL_CHECK_ARG(std::isfinite(p.temperature) && p.temperature >= 0 && p.temperature <= 100,
                   "temperature is ", p.temperature, ", must be in [0, 100]");
  CPFILL_CHECK_ARG(p.top_k >= 0, "top_k is ", p.top_k, ", must be >= 0 (0: every token)");
  CPFILL_CHECK_ARG(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1, "top_p is ", p.top_p,
                   ", must be in (0, 1]");
  CPFILL_CHECK_ARG(p.logprobs >= 0 && p.logprobs <= 20 && p.logprobs <= vocab, "logprobs is ",
                   p.logprobs, ", must be in [0, 20]");
  return absl::OkStatus();
}

SampledToken SampleToken(std::span<const float> logits, const SamplingParams& p, uint64_t step) {
  SampledToken out;
  if (logits.empty()) return out;
  const bool keep_all =
      p.top_p >= 1.0 && (p.top_k <= 0 || static_cast<size_t>(p.top_k) >= logits.size());
  if (p.temperature == 0 || p.top_k == 1) {
    out.id = Argmax(logits);
  } else {
    const double scale = 1.0 / p.temperature;
    const uint64_t key = DrawKey(p.seed, step);
    if (keep_all) {
      out.id = Draw(logits, nullptr, scale, key);
    } else {
      const double log_z = p.top_p < 1.0 ? LogSumExp(logits, scale) : 0.0;
      const std::vector<int32_t> kept = Candidates(logits, p, scale, log_z);
      out.id = Draw(logits, &kept, scale, key);
    }
  }
  // Log-probabilities only when asked: a log-sum-exp over Llama 3's 128K logits took about 2 ms
  // of every decode step on the host (an H100's 32K step is 14 ms).
  if (p.logprobs == 0) return out;
  const double log_z = LogSumExp(logits, 1.0);
  out.logprob = double(logits[out.id]) - log_z;
  for (int32_t id : MostLikely(logits, static_cast<size_t>(p.logprobs))) {
    out.top.push_back({id, double(logits[id]) - log_z});
  }
  return out;
}

}  // namespace cpfill::runtime
