// cpfill/attention/sparq/sparq_test_util.h — random SparQ batches and the comparisons the
// CPU, CP and CUDA tests share. Test code only.
//
//   RandomSparqBatch data({.num_heads = 8, .num_kv_heads = 2, .head_dim = 64}, {300, 17}, 7);
//   SparqBatch b = data.Batch({.r = 8, .k = 32, .local_window = 4});
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/sparq/sparq.h"
#include "base/random.h"

namespace cpfill::attention::sparq::testing {

// Whole sequences on one rank, values uniform in [-1, 1) from (seed, tensor, index). Queries
// are scaled so softmaxes are peaky enough for top-k to matter (as trained models' are).
struct RandomSparqBatch {
  SparqShape shape;
  std::vector<int64_t> begin, len;
  std::vector<float> q, k, v;

  RandomSparqBatch(SparqShape sh, std::vector<int64_t> lens, uint64_t seed, float q_scale = 3.0f)
      : shape(sh), len(std::move(lens)) {
    int64_t rows = 0;
    for (int64_t l : len) {
      begin.push_back(rows);
      rows += l;
    }
    const int64_t kv = rows * sh.num_kv_heads * sh.head_dim;
    q.resize(len.size() * sh.num_heads * sh.head_dim);
    k.resize(kv);
    v.resize(kv);
    for (size_t i = 0; i < q.size(); ++i) q[i] = q_scale * UniformAt(seed, 1, i);
    for (int64_t i = 0; i < kv; ++i) {
      k[i] = UniformAt(seed, 2, i);
      v[i] = UniformAt(seed, 3, i);
    }
  }
  SparqBatch Batch(SparqConfig config) const {
    return {.shape = shape,
            .config = config,
            .q = q.data(),
            .k = k.data(),
            .v = v.data(),
            .kv_begin = begin,
            .kv_len = len};
  }
};

// Largest |got - want| / (atol + rtol |want|) over all elements; NaN counts as failure (+inf).
template <typename A, typename B>
double WorstRatio(const std::vector<A>& got, const std::vector<B>& want, double atol, double rtol) {
  double worst = got.size() == want.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    const double r = std::isfinite(g) ? std::fabs(g - w) / (atol + rtol * std::fabs(w)) : INFINITY;
    worst = std::max(worst, r);
  }
  return worst;
}

inline std::string ConfigName(const SparqShape& sh, const SparqConfig& c) {
  return "heads " + std::to_string(sh.num_heads) + ":" + std::to_string(sh.num_kv_heads) + " d " +
         std::to_string(sh.head_dim) + " r " + std::to_string(c.r) + " k " + std::to_string(c.k) +
         " l " + std::to_string(c.local_window) + (c.oracle ? " oracle" : "");
}

}  // namespace cpfill::attention::sparq::testing
