// InPlaceBeatsGather on the host (no GPU needed): short prefills after long cached keys read the
// blocks in place; long prefills, and steps whose shared prefix is gathered once for many
// queries, gather. The shapes are those of the H100 measurement it was fitted on
// (bench/results/2026-11-27-h100-paged-in-place-runs).
#include <gtest/gtest.h>

#include <vector>

#include "attention/cuda/prefix_batched_cuda.h"

namespace cpfill::attention::cuda {
namespace {

struct Step {
  AttentionShape shape;
  std::vector<SequenceSlice> slices;
  PagedGather plan;
};

// B sequences of S new tokens after P cached ones, heads:kv_heads at d128; `shared`: the prefix
// is a root gathered once (else each sequence's keys are gathered whole).
Step SuffixStep(int heads, int kv_heads, int64_t p, int64_t s, int64_t b, bool shared) {
  Step step;
  step.shape = {.num_heads = heads,
                .num_kv_heads = kv_heads,
                .head_dim = 128,
                .softmax_scale = 0.1f,
                .causal = true};
  for (int64_t i = 0; i < b; ++i) {
    step.slices.push_back({.q_begin = i * s, .q_len = s, .kv_begin = i * (p + s), .kv_len = p + s});
  }
  step.plan.rows = shared ? p + b * s : b * (p + s);
  return step;
}

bool InPlace(const Step& s) { return InPlaceBeatsGather(s.shape, s.plan, s.slices); }

TEST(PagedReadRule, ShortPrefillsAfterLongKeysReadInPlace) {
  // Measured 1.12x, 1.33x, 1.11x and 1.19x in place.
  EXPECT_TRUE(InPlace(SuffixStep(8, 1, 4096, 256, 1, false)));
  EXPECT_TRUE(InPlace(SuffixStep(32, 8, 65536, 256, 1, false)));
  EXPECT_TRUE(InPlace(SuffixStep(8, 1, 1024, 256, 1, false)));
  EXPECT_TRUE(InPlace(SuffixStep(32, 8, 1024, 256, 256, false)));
}

TEST(PagedReadRule, LongPrefillsAndSharedRootsGather) {
  // Measured 0.95x, 0.98x, 0.80x and 0.96x in place.
  EXPECT_FALSE(InPlace(SuffixStep(8, 1, 16384, 2048, 1, false)));
  EXPECT_FALSE(InPlace(SuffixStep(32, 8, 4096, 2048, 1, false)));
  EXPECT_FALSE(InPlace(SuffixStep(32, 8, 65536, 256, 256, true)));
  EXPECT_FALSE(InPlace(SuffixStep(8, 1, 16384, 256, 8, true)));
}

TEST(PagedReadRule, NoWorkNoSwitch) {
  Step empty = SuffixStep(8, 1, 4096, 256, 1, false);
  empty.slices.clear();
  EXPECT_FALSE(InPlace(empty));
}

}  // namespace
}  // namespace cpfill::attention::cuda
