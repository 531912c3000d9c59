// cpfill/attention/cuda/key_split.h — a prefill call of few query tiles over long keys, split
// along its keys (the Hopper path of PartialAttentionCuda).
//
// The Hopper kernel gives a CTA one 128-row folded query tile of one KV head and walks all of
// its keys. A short prefill after a long prefix is then a few work items on 132 SMs: 256 suffix
// tokens after a 4K prefix at 8:1 heads are 16. Such a call runs instead as one launch over
// `parts` copies of each slice, part p holding the p-th share of the slice's key tiles and
// writing its fp32 (O, LSE) to rows p * q_tokens + q_begin of a partial buffer (SliceDesc::
// o_begin: the queries are read in place, not copied); MergePartialsCuda then merges the parts
// exactly into the call's output. FlashAttention-3 splits such calls the same way (num_splits).
//
//   const KeySplit split = PlanKeySplit(a, sms);
//   if (split.parts > 1) ... LaunchHopperAttention(parts_args, work, ..., split.out_rows) ...
#pragma once

#include <cstdint>
#include <vector>

#include "attention/attention.h"
#include "attention/cuda/attention_cuda.h"

namespace cpfill::attention::cuda::internal {

struct KeySplit {
  int parts = 1;                      // 1: the call runs as it is
  std::vector<SequenceSlice> slices;  // part-major: part p's slices in the call's order
  std::vector<int64_t> out_rows;      // per slice of `slices`: its first row in the parts' buffer
};

// The split of a call `a` on a GPU of `sms` SMs: as many parts as fill one wave with the call's
// work items (query tiles x KV heads), at most kMaxMergeParts (one merge), no part without a key
// tile, one launch (kMaxHopperSlices slices). No split (parts 1) where the items already fill
// half the GPU, for the running merge (kMergeIntoFloat32: the merge cannot write in place), calls
// with a query row in no slice with keys, or CPFILL_ATTENTION_KEY_SPLIT=off. Paged K/V (which the
// caller has checked the Hopper kernel reads in place, PagedPrefillOnHopper): parts start on a
// block, their shares counted in whole 128-key tiles that are also whole blocks.
KeySplit PlanKeySplit(const CudaAttentionArgs& a, int sms);

// True when PartialAttentionCuda runs `a` in key parts on this device (the Hopper kernel, and
// PlanKeySplit splits it).
bool SplitsKeys(const CudaAttentionArgs& a);

}  // namespace cpfill::attention::cuda::internal
