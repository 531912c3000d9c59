// Naive fp64 attention: one (query, head) at a time, two passes over its keys (max, then the
// exponentials), nothing shared, nothing blocked. The softmax weights are online_softmax.h's
// LseMerge, the definition every merge shares.

#include "attention/reference.h"

#include <cmath>
#include <limits>

#include "attention/online_softmax.h"

namespace cpfill::attention {

void ReferenceAttention(const AttentionParams& p, std::vector<double>* o,
                        std::vector<double>* lse) {
  const AttentionShape& sh = p.shape;
  const int64_t heads = sh.num_heads;
  const int64_t dim = sh.head_dim;
  const int group = sh.group_size();
  o->assign(p.q_tokens * heads * dim, 0.0);
  lse->assign(p.q_tokens * heads, -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  std::vector<int64_t> keys;  // visible key rows of the current query

  for (int64_t si = 0; si < p.num_slices; ++si) {
    const SequenceSlice& s = p.slices[si];
    for (int64_t qi = s.q_begin; qi < s.q_begin + s.q_len; ++qi) {
      const int32_t qp = p.q_pos[qi];
      if (qp < 0) continue;
      keys.clear();
      for (int64_t kj = s.kv_begin; kj < s.kv_begin + s.kv_len; ++kj) {
        const int32_t kp = p.k_pos[kj];
        if (kp >= 0 && (!sh.causal || kp <= qp)) keys.push_back(kj);
      }
      if (keys.empty()) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t kvh = h / group;
        const float* q = p.q + (qi * heads + h) * dim;
        // Softmax is the LSE merge with one key per part (LSE = score, O = its value row).
        scores.assign(keys.size(), 0.0);
        LseMerge<double> merge;
        for (size_t n = 0; n < keys.size(); ++n) {
          const float* k = p.k + (keys[n] * sh.num_kv_heads + kvh) * dim;
          double dot = 0.0;
          for (int64_t d = 0; d < dim; ++d) dot += double{q[d]} * double{k[d]};
          scores[n] = dot * double{sh.softmax_scale};
          merge.Add(scores[n], static_cast<int>(n));
        }
        double rest = 0.0;
        double* out = o->data() + (qi * heads + h) * dim;
        for (size_t n = 0; n < keys.size(); ++n) {
          const double w = merge.Weight(scores[n], static_cast<int>(n));
          if (static_cast<int>(n) != merge.arg_max()) rest += w;
          const float* v = p.v + (keys[n] * sh.num_kv_heads + kvh) * dim;
          for (int64_t d = 0; d < dim; ++d) out[d] += w * double{v[d]};
        }
        const double inv_sum = LseMerge<double>::Normalizer(rest);
        for (int64_t d = 0; d < dim; ++d) out[d] *= inv_sum;
        (*lse)[qi * heads + h] = merge.Lse(rest);
      }
    }
  }
}

}  // namespace cpfill::attention
