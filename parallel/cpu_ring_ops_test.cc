// CpuRingOps::Attend on paged K/V whose sequences share leading blocks (prefix-batched decode,
// runtime/serving/prefix_cache.md): the roots FindSharedBlocks makes, run and merged, give every
// sequence its attention over its own keys.
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
// reference is the same either way). `generation`: PagedKv::generation.
void Step(CpuRingOps& ops, SharedBlocksProblem& t, bool batch, bool fold, uint64_t generation = 0) {
  attention::PagedKv paged = t.Paged(t.table.data(), sizeof(float), batch);
  paged.generation = generation;
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
// each sequence's attention over its own keys; batched, the roots `want` counts.
void CheckStepsOf(attention::testing::SharedBlocksSpec spec, uint64_t seed,
                  const attention::PrefixBatchCounts& want) {
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
        EXPECT_EQ(did.roots, batch ? want.roots : 0);
        EXPECT_EQ(did.sequences, batch ? want.sequences : 0);
        EXPECT_EQ(did.key_rows_saved, batch ? want.key_rows_saved : 0);
      }
    }
  }
}

// The 5 forks one root over their 4 shared blocks of 16 rows.
constexpr attention::PrefixBatchCounts kFiveForks = {
    .roots = 1, .sequences = 5, .key_rows_saved = 4 * 64};

// Decode steps (one query row per sequence): read in place, the forks one root.
TEST(CpuRingOps, PagedStepsBatchSharedBlocksExactly) {
  CheckStepsOf({.shared_blocks = 4, .own_rows = {5, 16, 0, 40, 7, 9, 1}, .sharing = 5}, 7,
               kFiveForks);
}

// A prefill step over paged K/V (many query rows per sequence, as after cached rows): gathered,
// the shared blocks once, every run of forks one root however many rows.
TEST(CpuRingOps, PagedPrefillStepsGatherSharedBlocksOnce) {
  CheckStepsOf(
      {.shared_blocks = 4, .own_rows = {25, 16, 9, 40, 7, 19, 30}, .sharing = 5, .queries = 9}, 17,
      kFiveForks);
}

// A document under a system prompt (the last 3 of the 5 forks share 2 more blocks): a tree of
// three levels, decode and prefill steps.
TEST(CpuRingOps, NestedSharedBlocksAreLevelsOfTheirOwn) {
  const attention::PrefixBatchCounts want = {
      .roots = 2, .sequences = 5 + 3, .key_rows_saved = 4 * 64 + 2 * 32};
  for (int64_t queries : {1, 9}) {
    SCOPED_TRACE(queries == 1 ? "decode" : "prefill");
    CheckStepsOf({.shared_blocks = 4,
                  .own_rows = {25, 16, 39, 40, 33, 19, 30},
                  .sharing = 5,
                  .nested_blocks = 2,
                  .nested_sharing = 3,
                  .queries = queries},
                 23, want);
  }
}

// A forward's layers run the same steps: each is planned once per table generation. Fork 1's
// table then moves to copies of the shared blocks (the same keys, so the same answers): under
// the same generation the step keeps its plan (a generation names one table's contents), under
// a new one it is planned again and fork 1 is no longer in the root.
TEST(CpuRingOps, PlansAStepOncePerTableGeneration) {
  ThreadPool pool(2);
  CpuRingOps ops(&pool);
  const attention::AttentionShape shape = MakeShape(8, 2, 64, true);
  SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape, {.shared_blocks = 4, .own_rows = {5, 16, 9, 40, 7}, .sharing = 5, .queries = 9}, 31);
  const auto batched_sequences = [&](uint64_t generation) -> int64_t {
    const attention::PrefixBatchCounts before = ops.prefix_batch_counts();
    Step(ops, t, /*batch=*/true, /*fold=*/false, generation);
    attention::testing::ExpectOutputsMatch(shape, t.pb.q_tokens, t.pb.o.data(), t.pb.lse.data(),
                                           t.ref_o, t.ref_lse);
    return (ops.prefix_batch_counts() - before).sequences;
  };
  EXPECT_EQ(batched_sequences(7), 5);
  const size_t block = size_t(t.block_tokens) * shape.num_kv_heads * shape.head_dim;
  const int64_t fork1 = t.seq_table_begin[1];
  for (int64_t b = 0; b < 4; ++b) {
    const int32_t copy = static_cast<int32_t>(t.pool_k.size() / block);
    const size_t from = size_t(t.table[fork1 + b]) * block;
    t.pool_k.insert(t.pool_k.end(), t.pool_k.begin() + from, t.pool_k.begin() + from + block);
    t.pool_v.insert(t.pool_v.end(), t.pool_v.begin() + from, t.pool_v.begin() + from + block);
    t.table[fork1 + b] = copy;
  }
  EXPECT_EQ(batched_sequences(7), 5);
  EXPECT_EQ(batched_sequences(8), 3);  // forks 2 to 4; 0 and 1 alone
}

}  // namespace
}  // namespace cpfill::parallel
