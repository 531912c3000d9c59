#include "attention/sparq/sparq_cpu.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "attention/online_softmax.h"
#include "base/status.h"

namespace cpfill::attention::sparq {
namespace {

const float* QRow(const SparqBatch& b, int64_t seq, int head) {
  return b.q + (seq * b.shape.num_heads + head) * b.shape.head_dim;
}
const float* KvRow(const SparqBatch& b, const float* t, int64_t seq, int kv_head, int64_t j) {
  return t + ((b.kv_begin[seq] + j) * b.shape.num_kv_heads + kv_head) * b.shape.head_dim;
}

// The r components of largest summed |q| over the group; ties keep the lower index.
std::vector<int> TopComponents(const SparqBatch& b, int64_t seq, int kv_head, int r) {
  const int d = b.shape.head_dim, group = b.shape.group_size();
  std::vector<float> mass(d, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* q = QRow(b, seq, kv_head * group + g);
    for (int c = 0; c < d; ++c) mass[c] += std::fabs(q[c]);
  }
  std::vector<int> idx(d);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int c) { return mass[a] > mass[c]; });
  idx.resize(r);
  std::sort(idx.begin(), idx.end());  // ascending: the gather walks each key row forwards
  return idx;
}

}  // namespace

absl::Status ValidateSparqBatch(const SparqBatch& b) {
  const SparqShape& sh = b.shape;
  const SparqConfig& c = b.config;
  CPFILL_CHECK_ARG(sh.num_heads > 0 && sh.num_kv_heads > 0 && sh.head_dim > 0 &&
                       sh.num_heads % sh.num_kv_heads == 0,
                   "sparq: bad shape: ", sh.num_heads, " heads, ", sh.num_kv_heads,
                   " kv heads, head dim ", sh.head_dim);
  CPFILL_CHECK_ARG(c.oracle || (c.r >= 1 && c.r <= sh.head_dim), "sparq: r = ", c.r,
                   " must lie in [1, head_dim = ", sh.head_dim, "]");
  CPFILL_CHECK_ARG(c.k >= 1 && c.local_window >= 0, "sparq: k = ", c.k, ", l = ", c.local_window,
                   ": need k >= 1, l >= 0");
  CPFILL_CHECK_ARG(b.kv_begin.size() == b.kv_len.size() &&
                       (b.seq_len.empty() || b.seq_len.size() == b.kv_len.size()),
                   "sparq: kv_begin, kv_len and seq_len must have one entry per sequence");
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    CPFILL_CHECK_ARG(b.kv_len[s] >= 0 && b.kv_begin[s] >= 0 && b.kv_len[s] <= b.global_len(s),
                     "sparq: sequence ", s, " has ", b.kv_len[s], " local rows of ",
                     b.global_len(s));
  }
  CPFILL_CHECK_ARG(b.num_seqs() == 0 || (b.q && b.k && b.v), "sparq: null q, k or v");
  return absl::OkStatus();
}

void Normaliser::Merge(const Normaliser& o) {
  if (o.max == -INFINITY) return;
  if (o.max > max) {
    sum = sum * std::exp(max - o.max) + o.sum;  // exp(-inf) = 0 when this one was empty
    max = o.max;
  } else {
    sum += o.sum * std::exp(o.max - max);
  }
}

GroupQuery PrepareGroupQuery(const SparqBatch& b, int64_t seq, int kv_head) {
  const int d = b.shape.head_dim, group = b.shape.group_size();
  GroupQuery gq{.group = group, .head_dim = d};
  gq.components = TopComponents(b, seq, kv_head, b.config.effective_r(d));
  const int r = static_cast<int>(gq.components.size());
  gq.q_hat.resize(group * r);
  gq.q_exact.resize(group * d);
  for (int g = 0; g < group; ++g) {
    const float* q = QRow(b, seq, kv_head * group + g);
    float l1_all = 0, l1_hat = 0;
    for (int c = 0; c < d; ++c) l1_all += std::fabs(q[c]);
    for (int c : gq.components) l1_hat += std::fabs(q[c]);
    // tau_g = sqrt(d * coverage): a query with most of its L1 mass in i1 keeps sqrt(d).
    const float tau = std::sqrt(d * (l1_all > 0 ? l1_hat / l1_all : 1.0f));
    for (int t = 0; t < r; ++t) gq.q_hat[g * r + t] = q[gq.components[t]] / tau;
    for (int c = 0; c < d; ++c) gq.q_exact[g * d + c] = q[c] / std::sqrt(static_cast<float>(d));
  }
  return gq;
}

void ApproximateLogits(const SparqBatch& b, int64_t seq, int kv_head, const GroupQuery& gq,
                       float* logits, Normaliser* norms) {
  const int64_t n = b.kv_len[seq];
  const int r = static_cast<int>(gq.components.size());
  for (int g = 0; g < gq.group; ++g) norms[g] = Normaliser{};
  for (int64_t j = 0; j < n; ++j) {
    const float* k = KvRow(b, b.k, seq, kv_head, j);
    for (int g = 0; g < gq.group; ++g) {
      const float* qh = &gq.q_hat[g * r];
      float dot = 0;
      for (int t = 0; t < r; ++t) dot += qh[t] * k[gq.components[t]];
      logits[g * n + j] = dot;
      norms[g].Merge({dot, 1.0f});
    }
  }
}

std::vector<LocalCandidate> LocalCandidates(const SparqBatch& b, int64_t seq, int group,
                                            const float* logits, const float* lse, int64_t count) {
  const int64_t n = b.kv_len[seq];
  std::vector<LocalCandidate> all(n);
  for (int64_t j = 0; j < n; ++j) {
    float key = 0;
    for (int g = 0; g < group; ++g) key += std::exp(logits[g * n + j] - lse[g]);
    all[j] = {{b.position(seq, j), key}, j};
  }
  const int64_t window_begin = WindowBegin(b.global_len(seq), b.config.local_window);
  const int64_t m = std::min(count, n);
  std::partial_sort(all.begin(), all.begin() + m, all.end(),
                    [&](const LocalCandidate& x, const LocalCandidate& y) {
                      return SelectedBefore(x.c, y.c, window_begin);
                    });
  all.resize(m);
  return all;
}

std::vector<Candidate> SelectTop(std::vector<Candidate> all, int64_t window_begin, int64_t count) {
  const int64_t m = std::min<int64_t>(count, all.size());
  std::partial_sort(
      all.begin(), all.begin() + m, all.end(),
      [&](const Candidate& x, const Candidate& y) { return SelectedBefore(x, y, window_begin); });
  all.resize(m);
  return all;
}

void ComputeGroupPartial(const SparqBatch& b, int64_t seq, int kv_head, const GroupQuery& gq,
                         const float* logits, const Normaliser* norms,
                         std::span<const int64_t> rows, float* record) {
  const int d = gq.head_dim, n = static_cast<int>(b.kv_len[seq]);
  const PartialLayout lay{gq.group, d};
  std::vector<float> p(rows.size());
  for (int g = 0; g < gq.group; ++g) {
    // Exact softmax over the selected rows (one pass for the max, one for the weights).
    float mx = -INFINITY, sel = 0;
    for (size_t t = 0; t < rows.size(); ++t) {
      const float* k = KvRow(b, b.k, seq, kv_head, rows[t]);
      float dot = 0;
      for (int c = 0; c < d; ++c) dot += gq.q_exact[g * d + c] * k[c];
      p[t] = dot;
      mx = std::max(mx, dot);
      sel += std::exp(logits[g * n + rows[t]] - norms[g].max);
    }
    float sum = 0;
    for (float& x : p) sum += (x = std::exp(x - mx));
    float* o = record + lay.o(g);
    std::fill(o, o + d, 0.0f);
    for (size_t t = 0; t < rows.size(); ++t) {
      const float* v = KvRow(b, b.v, seq, kv_head, rows[t]);
      for (int c = 0; c < d; ++c) o[c] += p[t] * v[c];
    }
    for (int c = 0; c < d && sum > 0; ++c) o[c] /= sum;
    record[lay.lse(g)] = rows.empty() ? -INFINITY : mx + std::log(sum);
    record[lay.norm_max(g)] = norms[g].max;
    record[lay.norm_sum(g)] = norms[g].sum;
    record[lay.sel_sum(g)] = sel;
  }
  float* v_sum = record + lay.v_sum();
  if (b.v_sum != nullptr) {
    const float* src = b.v_sum + (seq * b.shape.num_kv_heads + kv_head) * d;
    std::copy(src, src + d, v_sum);
  } else {
    std::fill(v_sum, v_sum + d, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = KvRow(b, b.v, seq, kv_head, j);
      for (int c = 0; c < d; ++c) v_sum[c] += v[c];
    }
  }
  record[lay.rows()] = static_cast<float>(n);
  record[lay.selected()] = static_cast<float>(rows.size());
}

void FinishGroup(const PartialLayout& lay, const float* records, int parts, float* y) {
  const int d = lay.head_dim;
  float rows = 0, selected = 0;
  std::vector<float> v_bar(d, 0.0f);
  for (int r = 0; r < parts; ++r) {
    const float* rec = records + static_cast<int64_t>(r) * lay.floats();
    rows += rec[lay.rows()];
    selected += rec[lay.selected()];
    for (int c = 0; c < d; ++c) v_bar[c] += rec[lay.v_sum() + c];
  }
  for (int c = 0; c < d && rows > 0; ++c) v_bar[c] /= rows;
  for (int g = 0; g < lay.group; ++g) {
    float* out = y + g * d;
    std::fill(out, out + d, 0.0f);
    if (rows == 0) continue;
    // alpha: the selected share of the approximate softmax mass, parts rescaled to one max.
    Normaliser total, chosen;
    LseMerge<float> merge;
    for (int r = 0; r < parts; ++r) {
      const float* rec = records + static_cast<int64_t>(r) * lay.floats();
      total.Merge({rec[lay.norm_max(g)], rec[lay.norm_sum(g)]});
      chosen.Merge({rec[lay.norm_max(g)], rec[lay.sel_sum(g)]});
      merge.Add(rec[lay.lse(g)], r);
    }
    float alpha =
        chosen.max == -INFINITY ? 0.0f : chosen.sum / total.sum * std::exp(chosen.max - total.max);
    if (selected == rows) alpha = 1.0f;  // every position attended: dense, v_bar unused
    float rest = 0;
    for (int r = 0; r < parts; ++r) {
      const float* rec = records + static_cast<int64_t>(r) * lay.floats();
      if (r != merge.arg_max()) rest += merge.Weight(rec[lay.lse(g)], r);
    }
    const float norm = merge.empty() ? 0.0f : LseMerge<float>::Normalizer(rest);
    for (int r = 0; r < parts && !merge.empty(); ++r) {
      const float* rec = records + static_cast<int64_t>(r) * lay.floats();
      const float w = merge.Weight(rec[lay.lse(g)], r) * norm;
      if (w == 0) continue;
      for (int c = 0; c < d; ++c) out[c] += w * rec[lay.o(g) + c];
    }
    for (int c = 0; c < d; ++c) out[c] = alpha * out[c] + (1 - alpha) * v_bar[c];
  }
}

namespace {

// One (sequence, KV head) on one rank: every stage, no exchange.
void RunGroup(const SparqBatch& b, int64_t seq, int kv_head, float* o,
              std::vector<int32_t>* positions) {
  const int group = b.shape.group_size(), d = b.shape.head_dim;
  const int64_t n = b.kv_len[seq];
  const GroupQuery gq = PrepareGroupQuery(b, seq, kv_head);
  std::vector<float> logits(group * n), lse(group);
  std::vector<Normaliser> norms(group);
  ApproximateLogits(b, seq, kv_head, gq, logits.data(), norms.data());
  for (int g = 0; g < group; ++g) lse[g] = norms[g].Lse();
  const auto chosen = LocalCandidates(b, seq, group, logits.data(), lse.data(), b.config.k);
  std::vector<int64_t> rows;
  for (const LocalCandidate& c : chosen) rows.push_back(c.row);
  std::sort(rows.begin(), rows.end());
  const PartialLayout lay{group, d};
  std::vector<float> record(lay.floats());
  ComputeGroupPartial(b, seq, kv_head, gq, logits.data(), norms.data(), rows, record.data());
  FinishGroup(lay, record.data(), 1, o + (seq * b.shape.num_heads + kv_head * group) * d);
  if (positions != nullptr) {
    positions->clear();
    for (int64_t j : rows) positions->push_back(b.position(seq, j));
  }
}

}  // namespace

absl::Status SparqAttentionCpu(const SparqBatch& b, float* o, SparqSelection* selection,
                               ThreadPool* pool) {
  CPFILL_RETURN_IF_ERROR(ValidateSparqBatch(b));
  CPFILL_CHECK_ARG(b.k_pos == nullptr && b.seq_len.empty(),
                   "SparqAttentionCpu holds whole sequences: k_pos and seq_len must be unset");
  const int kv_heads = b.shape.num_kv_heads;
  if (selection != nullptr) selection->positions.assign(b.num_seqs() * kv_heads, {});
  auto run = [&](int64_t item) {
    const int64_t seq = item / kv_heads;
    const int kv_head = static_cast<int>(item % kv_heads);
    RunGroup(b, seq, kv_head, o, selection != nullptr ? &selection->positions[item] : nullptr);
  };
  if (pool != nullptr) {
    pool->ParallelFor(b.num_seqs() * kv_heads, run);
  } else {
    for (int64_t i = 0; i < b.num_seqs() * kv_heads; ++i) run(i);
  }
  return absl::OkStatus();
}

}  // namespace cpfill::attention::sparq
