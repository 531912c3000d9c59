// cpfill/attention/sparq/sparq.h — SparQ attention (Ribar et al., App. A, Alg. 1) for decode:
// the types every implementation shares (fp64 reference, CPU, CP-sharded, CUDA) and the rules
// that make them select the same positions.
//
// One decode query per sequence attends to a subset of its KV cache. Per (sequence, KV head):
//   1. i1 = the r components with the largest sum over the group's query heads of |q_h| (GQA
//      form of the paper's code; ties: the lower component index first);
//   2. per query head h, approximate logits a_hj = q_h[i1] . k_j[i1] / tau_h with
//      tau_h = sqrt(d * |q_h[i1]|_1 / |q_h|_1), and s_hat_h = softmax_j(a_h) over all S positions;
//   3. ranking key_j = sum_h s_hat_hj; the selected set I = the first min(k, S) positions in the
//      order (in the local window desc, key desc, position asc). The window is the last l
//      positions (Alg. 1's mask m), so it is chosen first and counts against the k budget;
//   4. alpha_h = sum_{j in I} s_hat_hj (alpha := 1 when I holds every position);
//   5. y_h = alpha_h * softmax(q_h . K_I / sqrt(d)) V_I + (1 - alpha_h) * v_bar, where v_bar is
//      the mean of V over all S positions of the KV head.
// Oracle mode (the paper's upper bound): r = d, so tau = sqrt(d) and the "approximate" scores
// are the exact ones.
//
//   SparqBatch b{.shape = {32, 8, 128}, .config = {.r = 16, .k = 128, .local_window = 16},
//                .q = q, .k = k, .v = v, .kv_begin = begins, .kv_len = lens};
//   CPFILL_RETURN_IF_ERROR(ValidateSparqBatch(b));
//   SparqAttentionCpu(b, o.data(), &selection, &pool);          // sparq_cpu.h
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace cpfill::attention::sparq {

struct SparqConfig {
  int r = 16;            // components of q that rank positions, 1..head_dim
  int k = 128;           // positions attended per (sequence, KV head), window included
  int local_window = 0;  // l: the last l positions are always chosen first
  bool oracle = false;   // exact scores choose the top k (r taken as head_dim)
  int effective_r(int head_dim) const { return oracle ? head_dim : std::min(r, head_dim); }
};

struct SparqShape {
  int num_heads = 0;     // query heads (on this rank)
  int num_kv_heads = 0;  // divides num_heads
  int head_dim = 0;
  int group_size() const { return num_heads / num_kv_heads; }
};

// A batch of decode queries, one per sequence, against each sequence's (local) KV rows.
// Layouts (row-major fp32, host memory; the CUDA API has its own bf16 struct):
//   q        [num_seqs, num_heads, head_dim]
//   k, v     [kv_rows, num_kv_heads, head_dim]; sequence s owns rows kv_begin[s] .. + kv_len[s]
//   k_pos    [kv_rows] global position of each row in its sequence; null: rows are positions
//            0 .. kv_len[s]-1 in order (one rank holding the whole cache)
//   seq_len  [num_seqs] global length S of each sequence (the window is [S - l, S)); empty:
//            kv_len (one rank)
//   v_sum    [num_seqs, num_kv_heads, head_dim] sum of V over the sequence's (local) rows, as a
//            KV cache keeps it incrementally; null: summed from v
// A CP rank passes its own rows with their global positions; one rank passes everything.
struct SparqBatch {
  SparqShape shape;
  SparqConfig config;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  std::span<const int64_t> kv_begin;
  std::span<const int64_t> kv_len;
  const int32_t* k_pos = nullptr;
  std::span<const int64_t> seq_len;
  const float* v_sum = nullptr;

  int64_t num_seqs() const { return static_cast<int64_t>(kv_len.size()); }
  int64_t global_len(int64_t s) const { return seq_len.empty() ? kv_len[s] : seq_len[s]; }
  int32_t position(int64_t s, int64_t j) const {
    return k_pos != nullptr ? k_pos[kv_begin[s] + j] : static_cast<int32_t>(j);
  }
};

// Checks shapes and parameters: 1 <= r <= d (unless oracle), k >= 1, l >= 0, spans of equal
// length, local lengths within the global ones. InvalidArgument otherwise.
absl::Status ValidateSparqBatch(const SparqBatch& b);

// A position competing for selection: its global position and ranking key (sum_h s_hat_hj).
// Exchanged between CP ranks as is (8 bytes).
struct Candidate {
  int32_t position = -1;
  float key = 0.0f;
};
static_assert(sizeof(Candidate) == 8, "Candidate is exchanged between ranks as 8 bytes");

// The selection order of step 3: window positions first, then larger keys, then lower positions.
// A strict total order on distinct positions, so every rank and implementation agrees on it.
inline bool SelectedBefore(const Candidate& a, const Candidate& b, int64_t window_begin) {
  const bool wa = a.position >= window_begin, wb = b.position >= window_begin;
  if (wa != wb) return wa;
  if (a.key != b.key) return a.key > b.key;
  return a.position < b.position;
}

// First position of the local window of a sequence of `seq_len` positions.
inline int64_t WindowBegin(int64_t seq_len, int local_window) {
  return seq_len - std::min<int64_t>(local_window, seq_len);
}

}  // namespace cpfill::attention::sparq
