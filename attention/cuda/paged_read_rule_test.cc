// InPlaceBeatsGather and StepRuleOnGpu on the host (no GPU needed): short prefills after long
// cached keys read the blocks in place; long prefills, and steps whose shared prefix is gathered
// once for many queries, gather (the shapes of the H100 measurement it was fitted on,
// bench/results/2026-11-27-h100-paged-in-place-runs); a suffix step's roots must beat its flat
// step read in place (an H200's, bench/results/2026-11-28-h200-prefix-attention).
#include <gtest/gtest.h>

#include <vector>

#include "attention/cuda/prefix_batched_cuda.h"
#include "attention/prefix_batched.h"

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

// B forks of one P-token prompt, each with S new rows after it, in 64-token blocks: the forks'
// tables start with the prompt's blocks. Holds the tables FindSharedBlocks reads.
struct ForkedSuffixStep {
  Step step;
  std::vector<int32_t> table;
  std::vector<int64_t> seq_kv_begin, seq_table_begin;
  PagedKv Paged() const {
    return {.block_tokens = 64,
            .block_stride_bytes = 64 * 4096,
            .seq_kv_begin = seq_kv_begin,
            .seq_table_begin = seq_table_begin,
            .host_table = table};
  }
};

ForkedSuffixStep Forks(int heads, int kv_heads, int64_t p, int64_t s, int64_t b) {
  ForkedSuffixStep f{.step = SuffixStep(heads, kv_heads, p, s, b, false)};
  const int64_t prompt_blocks = p / 64, own_blocks = (s + 63) / 64;
  int32_t next = static_cast<int32_t>(prompt_blocks);
  for (int64_t i = 0; i < b; ++i) {
    f.seq_kv_begin.push_back(i * (p + s));
    f.seq_table_begin.push_back(static_cast<int64_t>(f.table.size()));
    for (int32_t blk = 0; blk < prompt_blocks; ++blk) f.table.push_back(blk);
    for (int64_t j = 0; j < own_blocks; ++j) f.table.push_back(next++);
  }
  return f;
}

// Roots the GPU keeps in a suffix step, against its flat step gathered or read in place.
int64_t GpuRoots(const ForkedSuffixStep& f, bool flat_in_place) {
  const SharedBlockRule rule = StepRuleOnGpu(f.step.slices, kGpuTreeCosts, flat_in_place);
  return FindSharedBlocks(f.step.shape, f.step.slices, f.Paged(), rule).counts.roots;
}

// On an H200 (bench/results/2026-11-28-h200-prefix-attention) the flat steps of these shapes read
// in place, and the gathered tree ran 0.90x (32:8 after 4K, B = 8), 0.98x (32:8 after 16K, B = 8)
// and 1.12x (8:1 after 64K, B = 32) their time.
TEST(PagedReadRule, SuffixRootsMustBeatTheFlatStepReadInPlace) {
  const ForkedSuffixStep lost = Forks(32, 8, 4096, 256, 8);
  const ForkedSuffixStep lost_too = Forks(32, 8, 16384, 256, 8);
  const ForkedSuffixStep won = Forks(8, 1, 65536, 256, 32);
  for (const ForkedSuffixStep* f : {&lost, &lost_too, &won}) {
    EXPECT_TRUE(FlatStepReadsInPlace(f->step.shape, f->step.slices, f->Paged()));
    EXPECT_EQ(GpuRoots(*f, /*flat_in_place=*/false), 1);  // against a gathered flat step
  }
  EXPECT_EQ(GpuRoots(lost, /*flat_in_place=*/true), 0);
  EXPECT_EQ(GpuRoots(lost_too, /*flat_in_place=*/true), 0);
  EXPECT_EQ(GpuRoots(won, /*flat_in_place=*/true), 1);
  // A long prefill's flat step gathers.
  const ForkedSuffixStep long_prefill = Forks(32, 8, 4096, 2048, 8);
  EXPECT_FALSE(FlatStepReadsInPlace(long_prefill.step.shape, long_prefill.step.slices,
                                    long_prefill.Paged()));
}

// Only a prefill step's merge is weighed against the flat step read in place; decode steps and
// CPFILL_PREFIX_TREE=always's zero costs keep theirs.
TEST(PagedReadRule, OnlyPrefillStepsWeighTheFlatStepReadInPlace) {
  const Step prefill = SuffixStep(32, 8, 4096, 256, 8, false);
  EXPECT_EQ(StepRuleOnGpu(prefill.slices, kGpuTreeCosts, true).costs.merge_cost,
            kMergeCostAgainstInPlace);
  EXPECT_EQ(StepRuleOnGpu(prefill.slices, kGpuTreeCosts, false).costs.merge_cost,
            kGpuTreeCosts.merge_cost);
  EXPECT_EQ(StepRuleOnGpu(prefill.slices, {}, true).costs.merge_cost, 0);
  const Step decode = SuffixStep(32, 8, 4096, 1, 8, false);
  EXPECT_EQ(StepRuleOnGpu(decode.slices, kGpuTreeCosts, true).costs.merge_cost,
            kGpuTreeCosts.merge_cost);
}

TEST(PagedReadRule, NoWorkNoSwitch) {
  Step empty = SuffixStep(8, 1, 4096, 256, 1, false);
  empty.slices.clear();
  EXPECT_FALSE(InPlace(empty));
}

}  // namespace
}  // namespace cpfill::attention::cuda
