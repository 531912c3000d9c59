// CpuRingOps::Attend on paged K/V whose sequences share leading blocks (issue 21): the roots
// FindSharedBlocks makes, run and merged, give every sequence its attention over its own keys.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/prefix_batched_test_util.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "parallel/ring_attention.h"

namespace cpfill::parallel {
namespace {

using attention::testing::kNaN;
using attention::testing::MakeShape;
using attention::testing::MakeSharedBlocksProblem;
using attention::testing::SharedBlocksProblem;

// One step on `ops`: fresh outputs, or folded into a running result that sees no key yet (so the
// reference is the same either way).
void Step(CpuRingOps& ops, SharedBlocksProblem& t, bool batch, bool fold) {
  const attention::PagedKv paged = t.Paged(t.table.data(), sizeof(float), batch);
  std::fill(t.pb.o.begin(), t.pb.o.end(), fold ? 0.0f : kNaN);
  std::fill(t.pb.lse.begin(), t.pb.lse.end(), fold ? -INFINITY : kNaN);
  const RingStepArgs args{.shape = t.pb.shape,
                          .q = t.pb.q.data(),
                          .q_pos = t.pb.q_pos.data(),
                          .q_tokens = t.pb.q_tokens,
                          .k = t.pool_k.data(),
                          .v = t.pool_v.data(),
                          .k_pos = t.pb.k_pos.data(),
                          .kv_tokens = t.pb.kv_tokens,
                          .slices = t.pb.slices,
                          .o = t.pb.o.data(),
                          .lse = t.pb.lse.data(),
                          .fold_into_output = fold,
                          .paged_kv = &paged};
  const absl::Status s = ops.Attend(args);
  ASSERT_TRUE(s.ok()) << s;
}

// Every stride (padding rows between the sequences or not), fresh and folded, batched and not:
// each sequence's attention over its own keys; batched, the 5 forks of `spec` are one root over
// their 4 shared blocks of 16 rows.
void CheckStepsOf(attention::testing::SharedBlocksSpec spec, uint64_t seed) {
  ThreadPool pool(2);
  CpuRingOps ops(&pool);
  const attention::AttentionShape shape = MakeShape(8, 2, 64, true);
  for (int64_t stride : {1, 2}) {
    spec.q_stride = stride;
    SharedBlocksProblem t = MakeSharedBlocksProblem(shape, spec, seed + stride);
    for (bool fold : {false, true}) {
      for (bool batch : {false, true}) {
        const attention::PrefixBatchCounts before = ops.prefix_batch_counts();
        Step(ops, t, batch, fold);
        if (::testing::Test::HasFatalFailure()) return;
        SCOPED_TRACE(absl::StrCat("stride ", stride, fold ? " fold" : " fresh",
                                  batch ? " batched" : " per sequence"));
        attention::testing::ExpectOutputsMatch(shape, t.pb.q_tokens, t.pb.o.data(), t.pb.lse.data(),
                                               t.ref_o, t.ref_lse);
        const attention::PrefixBatchCounts did = ops.prefix_batch_counts() - before;
        EXPECT_EQ(did.roots, batch ? 1 : 0);
        EXPECT_EQ(did.sequences, batch ? 5 : 0);
        EXPECT_EQ(did.key_rows_saved, batch ? 4 * 64 : 0);
      }
    }
  }
}

// Decode steps (one query row per sequence): read in place, the forks one root.
TEST(CpuRingOps, PagedStepsBatchSharedBlocksExactly) {
  CheckStepsOf({.shared_blocks = 4, .own_rows = {5, 16, 0, 40, 7, 9, 1}, .sharing = 5}, 7);
}

// A prefill step over paged K/V (many query rows per sequence, as after cached rows): gathered,
// the shared blocks once, every run of forks one root however many rows.
TEST(CpuRingOps, PagedPrefillStepsGatherSharedBlocksOnce) {
  CheckStepsOf(
      {.shared_blocks = 4, .own_rows = {25, 16, 9, 40, 7, 19, 30}, .sharing = 5, .queries = 9}, 17);
}

}  // namespace
}  // namespace cpfill::parallel
