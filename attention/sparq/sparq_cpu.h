// cpfill/attention/sparq/sparq_cpu.h — SparQ (sparq.h) on the CPU backend, fp32, and the stages
// it is made of, which the CP-sharded form (parallel/sparq_cp.h) runs with exchanges between them.
//
// Stages per (sequence, KV head) "group" on one rank's rows:
//   PrepareGroupQuery   i1 and the scaled query slices
//   ApproximateLogits   a_gj for the local rows, with each head's local softmax normaliser
//   LocalCandidates     the local top-m rows in SelectedBefore order, keyed against given LSEs
//   SelectTop           the first m of a union of candidate lists (same order)
//   ComputeGroupPartial exact softmax over the rows chosen here, alpha's parts, the V sum
//   FinishGroup         merges the partials of every rank into y
// On one rank they compose into SparqAttentionCpu.
//
//   ThreadPool pool(0);
//   std::vector<float> o(seqs * heads * d);
//   SparqSelection sel;
//   CPFILL_RETURN_IF_ERROR(SparqAttentionCpu(batch, o.data(), &sel, &pool));
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "attention/sparq/sparq.h"
#include "base/thread_pool.h"

namespace cpfill::attention::sparq {

// The query of one group, prepared once for both passes over K.
struct GroupQuery {
  int group = 0;
  int head_dim = 0;
  std::vector<int> components;  // i1: r component indices, ascending
  std::vector<float> q_hat;     // [group, r]: q_g[i1] / tau_g
  std::vector<float> q_exact;   // [group, head_dim]: q_g / sqrt(d)
};
GroupQuery PrepareGroupQuery(const SparqBatch& b, int64_t seq, int kv_head);

// A softmax normaliser over some logits: max and sum of exp(x - max). Empty: max -inf, sum 0.
struct Normaliser {
  float max = -INFINITY;
  float sum = 0.0f;
  float Lse() const { return max + std::log(sum); }
  // Folds another normaliser in (the merge of App. B eq. 4 on the denominators).
  void Merge(const Normaliser& o);
};
static_assert(sizeof(Normaliser) == 8, "exchanged between CP ranks as two floats");

// logits [group, n] for the n = kv_len[seq] local rows, norms [group].
void ApproximateLogits(const SparqBatch& b, int64_t seq, int kv_head, const GroupQuery& gq,
                       float* logits, Normaliser* norms);

// A local candidate: the exchanged (position, key) and the local row it came from.
struct LocalCandidate {
  Candidate c;
  int64_t row = 0;  // row index within the sequence's local rows
};
// The first min(count, n) local rows in SelectedBefore order, each keyed by
// sum_g exp(logits[g, j] - lse[g]).
std::vector<LocalCandidate> LocalCandidates(const SparqBatch& b, int64_t seq, int group,
                                            const float* logits, const float* lse, int64_t count);
// The first `count` of `all` in SelectedBefore order, sorted that way.
std::vector<Candidate> SelectTop(std::vector<Candidate> all, int64_t window_begin, int64_t count);

// One rank's part of a group's output, a flat fp32 record (exchanged between CP ranks as is):
//   per query head g (group of them): o[d] softmax(q_g K_sel / sqrt d) V_sel over this rank's
//     selected rows (normalised; 0 if none), lse, norm_max, norm_sum, sel_sum, where
//     (norm_max, norm_sum) is the head's approximate normaliser over this rank's rows and
//     sel_sum = sum over its selected rows of exp(a_gj - norm_max);
//   then v_sum[d] over this rank's rows, rows (count), selected (count). Counts in fp32 are exact
//   up to 2^24 positions.
struct PartialLayout {
  int group = 0;
  int head_dim = 0;
  int head_floats() const { return head_dim + 4; }
  int floats() const { return group * head_floats() + head_dim + 2; }
  int o(int g) const { return g * head_floats(); }
  int lse(int g) const { return o(g) + head_dim; }
  int norm_max(int g) const { return lse(g) + 1; }
  int norm_sum(int g) const { return lse(g) + 2; }
  int sel_sum(int g) const { return lse(g) + 3; }
  int v_sum() const { return group * head_floats(); }
  int rows() const { return v_sum() + head_dim; }
  int selected() const { return rows() + 1; }
};

// Writes this rank's record for (seq, kv_head): `rows` are local row indices of its selected
// positions; `norms` the local normalisers of ApproximateLogits.
void ComputeGroupPartial(const SparqBatch& b, int64_t seq, int kv_head, const GroupQuery& gq,
                         const float* logits, const Normaliser* norms,
                         std::span<const int64_t> rows, float* record);

// y [group, head_dim] from the records of every rank (`parts` records of layout.floats(), one
// after the other). alpha = sum_r sel_r / sum_r norm_r rescaled to a common max; 1 when every
// position was selected; no row at all: y = 0.
void FinishGroup(const PartialLayout& layout, const float* records, int parts, float* y);

// Selected positions per (sequence, KV head): positions[s * num_kv_heads + g], ascending.
struct SparqSelection {
  std::vector<std::vector<int32_t>> positions;
};

// One rank holding whole sequences (k_pos null, seq_len empty). o [num_seqs, num_heads,
// head_dim]; `selection` may be null. Groups run in parallel on `pool`.
absl::Status SparqAttentionCpu(const SparqBatch& b, float* o, SparqSelection* selection,
                               ThreadPool* pool);

}  // namespace cpfill::attention::sparq
