// cpfill/attention/reference.h — naive fp64 attention, the ground truth for tests and benchmarks.
//
// Reads the same fp32 tensors as PartialAttentionCpu and follows the same contract (attention.h),
// but computes every score, max, sum and output in double with plain loops: slow, obviously
// right. Test and benchmark code only (library cpfill_attention_reference).
//
//   std::vector<double> o, lse;
//   ReferenceAttention(params, &o, &lse);   // o [q_tokens, num_heads, head_dim], lse [.., heads]
#pragma once

#include <vector>

#include "attention/attention.h"

namespace cpfill::attention {

// Fills o (q_tokens * num_heads * head_dim) and lse (q_tokens * num_heads). Rows in no slice,
// padding queries and rows that see no key get O = 0 and LSE = -infinity. `p` must pass
// ValidateAttentionParams; p.o and p.lse are not touched.
void ReferenceAttention(const AttentionParams& p, std::vector<double>* o, std::vector<double>* lse);

}  // namespace cpfill::attention
