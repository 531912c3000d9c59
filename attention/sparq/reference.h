// cpfill/attention/sparq/reference.h — SparQ (sparq.h) in fp64 with plain loops, straight from
// Alg. 1: the ground truth of the CPU, CP and CUDA implementations. Test and benchmark code only.
//
// Independent of sparq_cpu.cc on purpose: it sorts every position with a comparator instead of
// selecting candidates, takes the softmax over all S positions in one pass, and averages V itself
// (SparqBatch::v_sum is ignored).
//
//   SparqReferenceResult ref = SparqReference(batch);   // batch.k_pos must be null (one rank)
//   ref.o[(s * heads + h) * d + c];  ref.selected[s * kv_heads + g];  // ascending positions
#pragma once

#include <cstdint>
#include <vector>

#include "attention/sparq/sparq.h"

namespace cpfill::attention::sparq {

struct SparqReferenceResult {
  std::vector<double> o;                       // [num_seqs, num_heads, head_dim]
  std::vector<double> alpha;                   // [num_seqs, num_heads]
  std::vector<std::vector<int32_t>> selected;  // [num_seqs * num_kv_heads], ascending
  // [num_seqs * num_kv_heads]: (last chosen key - first unchosen key) / last chosen key over
  // the positions chosen by their key (not the window); +inf when nothing competed. Tests
  // compare selections only where this margin dwarfs fp32 rounding (no near-ties).
  std::vector<double> margin;
};

// `b` must pass ValidateSparqBatch. Its rows may be a shard (k_pos, seq_len set): softmaxes and
// v_bar then run over those rows only, positions and the window are the global ones (how the
// local top-(k/N) variant of parallel/sparq_cp.h defines each rank's choice).
// `forced` (optional, [num_seqs * num_kv_heads] ascending positions) replaces the selection:
// alpha and the output follow Alg. 1 lines 6-7 for that set (how that variant is checked).
SparqReferenceResult SparqReference(const SparqBatch& b,
                                    const std::vector<std::vector<int32_t>>* forced = nullptr);

}  // namespace cpfill::attention::sparq
