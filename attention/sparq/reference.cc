#include "attention/sparq/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace cpfill::attention::sparq {
namespace {

struct GroupView {
  const SparqBatch& b;
  const std::vector<std::vector<int32_t>>* forced;
  int64_t seq;
  int kv_head;
  int64_t len;
  double q(int g, int c) const {
    const SparqShape& sh = b.shape;
    return b.q[(seq * sh.num_heads + kv_head * sh.group_size() + g) * sh.head_dim + c];
  }
  double k(int64_t j, int c) const { return Row(b.k, j)[c]; }
  double v(int64_t j, int c) const { return Row(b.v, j)[c]; }
  const float* Row(const float* t, int64_t j) const {
    const SparqShape& sh = b.shape;
    return t + ((b.kv_begin[seq] + j) * sh.num_kv_heads + kv_head) * sh.head_dim;
  }
};

// Alg. 1 line 1 in the GQA form: the r components of largest sum_g |q_g|, lower index on ties.
std::vector<int> TopComponents(const GroupView& gv, int r) {
  const int d = gv.b.shape.head_dim, group = gv.b.shape.group_size();
  std::vector<double> mass(d, 0.0);
  for (int g = 0; g < group; ++g) {
    for (int c = 0; c < d; ++c) mass[c] += std::fabs(gv.q(g, c));
  }
  std::vector<int> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return mass[a] > mass[c]; });
  order.resize(r);
  return order;
}

// s_hat[g][j]: softmax over all positions of the approximate logits, temperature tau_g.
std::vector<std::vector<double>> ApproximateScores(const GroupView& gv,
                                                   const std::vector<int>& i1) {
  const int d = gv.b.shape.head_dim, group = gv.b.shape.group_size();
  std::vector<std::vector<double>> s_hat(group, std::vector<double>(gv.len));
  for (int g = 0; g < group; ++g) {
    double l1_all = 0, l1_hat = 0;
    for (int c = 0; c < d; ++c) l1_all += std::fabs(gv.q(g, c));
    for (int c : i1) l1_hat += std::fabs(gv.q(g, c));
    const double tau = std::sqrt(d * (l1_all > 0 ? l1_hat / l1_all : 1.0));
    double mx = -INFINITY;
    for (int64_t j = 0; j < gv.len; ++j) {
      double dot = 0;
      for (int c : i1) dot += gv.q(g, c) * gv.k(j, c);
      s_hat[g][j] = dot / tau;
      mx = std::max(mx, s_hat[g][j]);
    }
    double sum = 0;
    for (double& x : s_hat[g]) sum += (x = std::exp(x - mx));
    for (double& x : s_hat[g]) x /= sum;
  }
  return s_hat;
}

void AttendGroup(const GroupView& gv, SparqReferenceResult* out) {
  const SparqShape& sh = gv.b.shape;
  const SparqConfig& cfg = gv.b.config;
  const int d = sh.head_dim, group = sh.group_size();
  const std::vector<int> i1 = TopComponents(gv, cfg.effective_r(d));
  const auto s_hat = ApproximateScores(gv, i1);
  // Alg. 1 lines 4-5: every position sorted by (window, summed score, position); take k.
  const int64_t global_len = gv.b.global_len(gv.seq);
  const int64_t window_begin = global_len - std::min<int64_t>(cfg.local_window, global_len);
  // Sorted as row indices; each row's global position decides the window and ties.
  std::vector<int32_t> order(gv.len);
  std::iota(order.begin(), order.end(), 0);
  auto pos = [&](int32_t j) { return gv.b.position(gv.seq, j); };
  std::vector<double> keys(gv.len, 0.0);
  for (int g = 0; g < group; ++g) {
    for (int64_t j = 0; j < gv.len; ++j) keys[j] += s_hat[g][j];
  }
  auto key = [&](int32_t j) { return keys[j]; };
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
    if ((pos(a) >= window_begin) != (pos(c) >= window_begin)) return pos(a) >= window_begin;
    if (key(a) != key(c)) return key(a) > key(c);
    return pos(a) < pos(c);
  });
  int64_t chosen = std::min<int64_t>(cfg.k, gv.len);
  const size_t group_index = gv.seq * sh.num_kv_heads + gv.kv_head;
  if (gv.forced != nullptr) {  // the given positions, as rows
    const auto& want = (*gv.forced)[group_index];
    order.clear();
    for (int32_t j = 0; j < gv.len; ++j) {
      if (std::binary_search(want.begin(), want.end(), pos(j))) order.push_back(j);
    }
    chosen = static_cast<int64_t>(order.size());
  }
  double margin = INFINITY;
  if (gv.forced == nullptr && chosen < gv.len && pos(order[chosen - 1]) < window_begin) {
    const double last = key(order[chosen - 1]);
    margin = (last - key(order[chosen])) / last;
  }
  out->margin[gv.seq * sh.num_kv_heads + gv.kv_head] = margin;
  order.resize(chosen);
  std::sort(order.begin(), order.end());
  const bool all = static_cast<int64_t>(order.size()) == global_len;
  std::vector<double> v_bar(d, 0.0);
  for (int64_t j = 0; j < gv.len; ++j) {
    for (int c = 0; c < d; ++c) v_bar[c] += gv.v(j, c) / gv.len;
  }
  for (int g = 0; g < group; ++g) {
    const int64_t head = gv.seq * sh.num_heads + gv.kv_head * group + g;
    double alpha = 0;
    for (int32_t j : order) alpha += s_hat[g][j];
    if (all) alpha = 1.0;
    // Lines 6-7: exact softmax over the selected positions, interpolated with v_bar.
    std::vector<double> logit(order.size());
    double mx = -INFINITY;
    for (size_t t = 0; t < order.size(); ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += gv.q(g, c) * gv.k(order[t], c);
      logit[t] = dot / std::sqrt(static_cast<double>(d));
      mx = std::max(mx, logit[t]);
    }
    double sum = 0;
    for (double& x : logit) sum += (x = std::exp(x - mx));
    double* o = &out->o[head * d];
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (size_t t = 0; t < order.size(); ++t) acc += logit[t] * gv.v(order[t], c);
      o[c] = alpha * acc / sum + (1 - alpha) * v_bar[c];
    }
    out->alpha[head] = alpha;
  }
  for (int32_t& j : order) j = pos(j);
  std::sort(order.begin(), order.end());
  out->selected[group_index] = std::move(order);
}

}  // namespace

SparqReferenceResult SparqReference(const SparqBatch& b,
                                    const std::vector<std::vector<int32_t>>* forced) {
  const SparqShape& sh = b.shape;
  SparqReferenceResult out;
  out.o.assign(b.num_seqs() * sh.num_heads * sh.head_dim, 0.0);
  out.alpha.assign(b.num_seqs() * sh.num_heads, 0.0);
  out.selected.resize(b.num_seqs() * sh.num_kv_heads);
  out.margin.assign(b.num_seqs() * sh.num_kv_heads, INFINITY);
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    if (b.kv_len[s] == 0) continue;  // no key: O = 0 (the contract of attention.h)
    for (int h = 0; h < sh.num_kv_heads; ++h) AttendGroup({b, forced, s, h, b.kv_len[s]}, &out);
  }
  return out;
}

}  // namespace cpfill::attention::sparq
