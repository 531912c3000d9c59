// FindSharedBlocks (prefix_batched.h): which slices of a paged decode step become one root.
#include <vector>

#include "attention/prefix_batched.h"
#include "attention/prefix_batched_test_util.h"
#include "gtest/gtest.h"

namespace cpfill::attention {
namespace {

using testing::MakeShape;
using testing::MakeSharedBlocksProblem;
using testing::SharedBlocksProblem;
using testing::SharedBlocksSpec;

SharedBlockTree Find(const SharedBlocksProblem& t, const SharedBlockRule& rule = {}) {
  const PagedKv paged = t.Paged(t.table.data(), 4, /*batch=*/true);
  return FindSharedBlocks(t.pb.shape, t.pb.slices, paged, rule);
}

// Four forks and two copies of the same prompt: one root over the forks' rows and shared rows,
// each fork's own rows after it, the copies whole.
TEST(FindSharedBlocks, ForksOfOnePromptShareOneRoot) {
  const AttentionShape shape = MakeShape(8, 2, 32, true);
  const SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape, {.shared_blocks = 3, .own_rows = {5, 16, 0, 40, 7, 9}, .sharing = 4}, 1);
  const SharedBlockTree tree = Find(t);
  EXPECT_EQ(tree.counts.roots, 1);
  EXPECT_EQ(tree.counts.sequences, 4);
  EXPECT_EQ(tree.counts.key_rows_saved, 3 * 48);
  ASSERT_EQ(tree.levels.size(), 2u);
  ASSERT_EQ(tree.levels[0].size(), 3u);
  EXPECT_EQ(tree.levels[0][0].q_begin, 0);
  EXPECT_EQ(tree.levels[0][0].q_len, 4);
  EXPECT_EQ(tree.levels[0][0].kv_begin, 0);
  EXPECT_EQ(tree.levels[0][0].kv_len, 48);
  EXPECT_EQ(tree.levels[0][1].kv_begin, t.pb.slices[4].kv_begin);
  EXPECT_EQ(tree.levels[0][1].kv_len, t.pb.slices[4].kv_len);
  ASSERT_EQ(tree.levels[1].size(), 3u);  // the fork with no rows of its own has none here
  EXPECT_EQ(tree.levels[1][0].kv_begin, 48);
  EXPECT_EQ(tree.levels[1][0].kv_len, 5);
  EXPECT_EQ(tree.levels[1][2].q_begin, 3);
  EXPECT_EQ(tree.levels[1][2].kv_begin, t.pb.slices[3].kv_begin + 48);
}

// Under TreeCosts a step keeps its roots only when they spare enough K/V values: the forks'
// root spares 3 x 48 key rows x 2 KV heads x 32 dims x 2 = 18432 values, and its second level
// merges 3 rows x 8 heads x 32 dims = 768; else the step is flat, every sequence whole.
TEST(FindSharedBlocks, RootsThatSpareTooLittleAreNotWorthALevel) {
  const AttentionShape shape = MakeShape(8, 2, 32, true);
  const SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape, {.shared_blocks = 3, .own_rows = {5, 16, 0, 40, 7, 9}, .sharing = 4}, 1);
  const auto roots = [&](const TreeCosts& costs) {
    const SharedBlockTree tree = Find(t, {.costs = costs});
    if (tree.counts.roots == 0) {
      EXPECT_EQ(tree.levels.size(), 1u);
      EXPECT_EQ(tree.levels[0].size(), t.pb.slices.size());
    }
    return tree.counts.roots;
  };
  EXPECT_EQ(roots({.min_saved_values = 18432}), 1);
  EXPECT_EQ(roots({.min_saved_values = 18433}), 0);
  EXPECT_EQ(roots({.merge_cost = 24.0}), 1);
  EXPECT_EQ(roots({.merge_cost = 24.01}), 0);
  EXPECT_EQ(roots(kGpuTreeCosts), 0);  // a few hundred rows: far too few for a GPU level
}

// Padding rows between the forks (a CP ring's pass-Q message) widen the root: it pays only while
// it reads the shared keys fewer times (m16 tiles of packed rows) than its members would.
TEST(FindSharedBlocks, PaddingRowsCountAgainstTheRoot) {
  const AttentionShape shape = MakeShape(8, 2, 32, true);  // 4 packed rows per query row
  const SharedBlocksSpec spec{.shared_blocks = 2, .own_rows = {3, 3, 3, 3}, .sharing = 4};
  SharedBlocksSpec two = spec, four = spec;
  two.q_stride = 2;   // 7 rows, 28 packed: 2 reads for 4 members
  four.q_stride = 4;  // 13 rows, 52 packed: 4 reads, no gain
  EXPECT_EQ(Find(MakeSharedBlocksProblem(shape, two, 2)).counts.roots, 1);
  EXPECT_EQ(Find(MakeSharedBlocksProblem(shape, four, 2)).counts.roots, 0);
  // Without a causal mask the padding rows would see the keys: no root spans them.
  EXPECT_EQ(Find(MakeSharedBlocksProblem(MakeShape(8, 2, 32, false), two, 2)).counts.roots, 0);
}

// A long run is cut at max_root_rows packed rows; without the host table nothing is grouped.
TEST(FindSharedBlocks, LongRunsAreCutAndNoHostTableMeansNoRoot) {
  const AttentionShape shape = MakeShape(8, 1, 32, true);  // 8 packed rows per query row
  const SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape, {.shared_blocks = 1, .own_rows = std::vector<int64_t>(40, 2), .sharing = 40}, 3);
  const SharedBlockTree tree = Find(t, {.rows_per_read = 16, .max_root_rows = 128});
  EXPECT_EQ(tree.counts.roots, 3);  // 16 + 16 + 8 members
  EXPECT_EQ(tree.counts.sequences, 40);
  const PagedKv plain = t.Paged(t.table.data(), 4, /*batch=*/false);
  const SharedBlockTree none = FindSharedBlocks(shape, t.pb.slices, plain);
  EXPECT_EQ(none.counts.roots, 0);
  ASSERT_EQ(none.levels.size(), 1u);
  EXPECT_EQ(none.levels[0].size(), t.pb.slices.size());
}

// A prefill step over the blocks (more query rows per slice than a decode step) is gathered:
// every run of sequences sharing blocks is a root, however many rows, and the gather copies the
// shared blocks once, each member's own rows once, and the other sequences whole.
TEST(PlanPagedGather, PrefillStepCopiesSharedBlocksOnce) {
  const AttentionShape shape = MakeShape(8, 1, 32, true);  // 8 packed rows per query row
  const SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape, {.shared_blocks = 3, .own_rows = {20, 33, 17, 40, 24}, .sharing = 3, .queries = 17},
      4);
  EXPECT_FALSE(GathersPagedKv(MakeSharedBlocksProblem(shape, {.own_rows = {3, 3}}, 4).pb.slices));
  ASSERT_TRUE(GathersPagedKv(t.pb.slices));
  // 17 rows x 8 heads already exceed the decode kernel's root: one only by the gathered rule.
  EXPECT_EQ(Find(t).counts.roots, 0);
  const SharedBlockTree tree = Find(t, RuleForStep(t.pb.slices));
  EXPECT_EQ(tree.counts.roots, 1);
  EXPECT_EQ(tree.counts.sequences, 3);
  const PagedKv paged = t.Paged(t.table.data(), 4, /*batch=*/true);
  const PagedGather g = PlanPagedGather(tree, paged, t.table);
  const int64_t shared = 3 * 16;
  EXPECT_EQ(g.rows, shared + (20 + 33 + 17) + (shared + 40) + (shared + 24));
  // Each copy takes its rows from the block that holds them, and every gathered row comes from
  // exactly one step row.
  const int64_t row = int64_t{shape.num_kv_heads} * shape.head_dim;
  std::vector<int64_t> from(g.rows, -1);
  for (const PagedGather::Copy& c : g.copies) {
    ASSERT_LE(c.rows, 16);
    EXPECT_EQ(c.block, t.table[paged.TableBegin(c.from_row)]);
    for (int64_t r = 0; r < c.rows; ++r) {
      ASSERT_EQ(from[c.to_row + r], -1) << "gathered row " << c.to_row + r << " copied twice";
      from[c.to_row + r] = c.from_row + r;
      EXPECT_EQ(t.pool_k[(c.block * 16 + r) * row], t.pb.k[(c.from_row + r) * row]);
    }
  }
  // The gathered slices read, at their rows, the step rows their tree slices read.
  const auto same_keys = [&](const std::vector<SequenceSlice>& gathered,
                             const std::vector<SequenceSlice>& step) {
    ASSERT_EQ(gathered.size(), step.size());
    for (size_t i = 0; i < step.size(); ++i) {
      EXPECT_EQ(gathered[i].q_begin, step[i].q_begin);
      EXPECT_EQ(gathered[i].q_len, step[i].q_len);
      ASSERT_EQ(gathered[i].kv_len, step[i].kv_len);
      for (int64_t r = 0; r < step[i].kv_len; ++r) {
        ASSERT_EQ(from[gathered[i].kv_begin + r], step[i].kv_begin + r) << "slice " << i;
      }
    }
  };
  ASSERT_EQ(g.levels.size(), tree.levels.size());
  for (size_t l = 0; l < g.levels.size(); ++l) same_keys(g.levels[l], tree.levels[l]);
  EXPECT_EQ(g.levels[0][0].q_len, 3 * 17);
  EXPECT_EQ(g.levels[0][0].kv_len, shared);
}

// Four forks of one document (4 shared blocks) in a prefill step; `odd` (if >= 0) shares only the
// first block with the others (a fork of the system prompt alone): its other entries are blocks
// of its own.
SharedBlocksProblem DocumentForks(int odd, int64_t stride = 1) {
  SharedBlocksProblem t = MakeSharedBlocksProblem(MakeShape(8, 2, 32, true),
                                                  {.shared_blocks = 4,
                                                   .own_rows = {5, 5, 5, 5},
                                                   .sharing = 4,
                                                   .q_stride = stride,
                                                   .queries = 9},
                                                  5);
  if (odd >= 0) {
    for (int b = 1; b < 4; ++b) t.table[t.seq_table_begin[odd] + b] = 1000 + b;
  }
  return t;
}

// A fork of the system prompt alone among a document's forks, first or last: one root over the
// block all four share, and under it one over the document's other 3 blocks for its three forks
// (Hydragen's hierarchical case): every shared block is read once.
TEST(FindSharedBlocks, ADocumentUnderASystemPromptIsALevelOfItsOwn) {
  for (int odd : {0, 3}) {
    SCOPED_TRACE(odd == 0 ? "the odd fork first" : "the odd fork last");
    const SharedBlocksProblem t = DocumentForks(odd);
    const SharedBlockTree tree = Find(t, RuleForStep(t.pb.slices));
    EXPECT_EQ(tree.counts.roots, 2);
    EXPECT_EQ(tree.counts.sequences, 4 + 3);
    EXPECT_EQ(tree.counts.key_rows_saved, 3 * 16 + 2 * 3 * 16);
    ASSERT_EQ(tree.levels.size(), 3u);
    ASSERT_EQ(tree.levels[0].size(), 1u);  // the system prompt's block under all 4 forks
    EXPECT_EQ(tree.levels[0][0].q_len, 4 * 9);
    EXPECT_EQ(tree.levels[0][0].kv_len, 16);
    ASSERT_EQ(tree.levels[1].size(), 2u);  // the odd fork's rest, whole, and the document's root
    const SequenceSlice& document = tree.levels[1][odd == 0 ? 1 : 0];
    EXPECT_EQ(document.q_len, 3 * 9);
    EXPECT_EQ(document.kv_len, 3 * 16);
    EXPECT_EQ(tree.levels[2].size(), 3u);  // the document forks' own 5 rows
    for (const SequenceSlice& own : tree.levels[2]) EXPECT_EQ(own.kv_len, 5);
  }
}

// A member with no rows past the root (a fork of the system prompt alone) between two forks that
// share more: no deeper root spans its queries, which would see that root's keys. Last, it is
// no obstacle.
TEST(FindSharedBlocks, AMemberWithNothingPastTheRootFencesDeeperRoots) {
  for (bool between : {true, false}) {
    SCOPED_TRACE(between ? "between" : "last");
    const std::vector<int64_t> own =
        between ? std::vector<int64_t>{40, 0, 40} : std::vector<int64_t>{40, 40, 0};
    SharedBlocksProblem t = MakeSharedBlocksProblem(
        MakeShape(8, 2, 32, true),
        {.shared_blocks = 2, .own_rows = own, .sharing = 3, .queries = 9}, 12);
    const int64_t a = t.seq_table_begin[0], c = t.seq_table_begin[between ? 2 : 1];
    for (int64_t b = 2; b < 4; ++b) t.table[c + b] = t.table[a + b];  // 2 more blocks shared
    EXPECT_EQ(Find(t, RuleForStep(t.pb.slices)).counts.roots, between ? 1 : 2);
  }
}

// Three levels from the test problem's nested sharing (the numeric checks' trees): 6 forks of a
// system prompt, the last 4 of them also of one document.
TEST(FindSharedBlocks, NestedSharingMakesThreeLevels) {
  const SharedBlocksProblem t = MakeSharedBlocksProblem(MakeShape(8, 2, 32, true),
                                                        {.shared_blocks = 2,
                                                         .own_rows = {5, 9, 40, 50, 37, 60, 11},
                                                         .sharing = 6,
                                                         .nested_blocks = 2,
                                                         .nested_sharing = 4,
                                                         .queries = 9},
                                                        6);
  const SharedBlockTree tree = Find(t, RuleForStep(t.pb.slices));
  EXPECT_EQ(tree.counts.roots, 2);
  EXPECT_EQ(tree.counts.key_rows_saved, 5 * 32 + 3 * 32);
  ASSERT_EQ(tree.levels.size(), 3u);
  EXPECT_EQ(tree.levels[0].size(), 2u);  // the system prompt's root, the last sequence whole
  EXPECT_EQ(tree.levels[1].size(), 3u);  // two forks' rest, the document's root
  EXPECT_EQ(tree.levels[2].size(), 4u);
  const PagedKv paged = t.Paged(t.table.data(), 4, /*batch=*/true);
  EXPECT_EQ(PlanPagedGather(tree, paged, t.table).rows,
            32 + (5 - 0) + (9 - 0) + 32 + (40 - 32) + (50 - 32) + (37 - 32) + (60 - 32) + 32 + 11);
}

// Query rows of a sequence with no key on this rank (a pass-Q message's real queries, not
// padding) between two forks split their run: a root over them would give them its keys. The two
// roots read the same blocks, which the gather copies once.
TEST(FindSharedBlocks, KeylessRowsBetweenForksSplitTheRun) {
  const SharedBlocksProblem t = DocumentForks(-1, /*stride=*/2);  // rows 9..17 of each slot spare
  const std::vector<SequenceSlice> keyless = {{.q_begin = 27, .q_len = 5}};  // after fork 1
  const PagedKv paged = t.Paged(t.table.data(), 4, /*batch=*/true);
  EXPECT_EQ(Find(t, RuleForStep(t.pb.slices)).counts.roots, 1);
  const SharedBlockTree tree =
      FindSharedBlocks(t.pb.shape, t.pb.slices, paged, RuleForStep(t.pb.slices), keyless);
  EXPECT_EQ(tree.counts.roots, 2);
  EXPECT_EQ(tree.counts.sequences, 4);
  EXPECT_EQ(PlanPagedGather(tree, paged, t.table).rows, 4 * 16 + 4 * 5);
}

// A decode step's outer roots wider than the rule's packed rows are gathered, the blocks once,
// up to max_rows; the rest of the tree stays in place. Forks of a system prompt (2 blocks), the
// last 4 of them also of a document (2 more blocks), 8:2 heads (4 packed rows a query row).
TEST(PlanWideRoots, GathersWideOuterRootsOnly) {
  const AttentionShape shape = MakeShape(8, 2, 32, true);
  std::vector<int64_t> own = {5, 9, 40, 50, 37, 60};
  SharedBlocksProblem t = MakeSharedBlocksProblem(
      shape,
      {.shared_blocks = 2, .own_rows = own, .sharing = 6, .nested_blocks = 2, .nested_sharing = 4},
      8);
  const SharedBlockTree tree = Find(t, {.max_root_rows = 1 << 20});
  ASSERT_EQ(tree.outer_roots.size(), 1u);
  ASSERT_EQ(tree.levels.size(), 3u);
  const PagedKv paged = t.Paged(t.table.data(), 4, /*batch=*/true);
  // 6 query rows x 4 = 24 packed rows under the outer root: re-read 24 / 16 - 1 = 0.5 times, 32
  // key rows x 2 KV heads x 32 dims x 2 = 4096 values once, 2048 again; 1 tile x 2 KV heads.
  const auto plan = [&](WideRootRule rule) {
    return PlanWideRoots(shape, tree, paged, t.table, rule);
  };
  const WideRootRule rule = {.min_packed_rows = 23,
                             .max_rows = 32,
                             .rows_per_read = 16,
                             .min_reread_values = 2048,
                             .rows_per_tile = 128,
                             .min_tiles = 2};
  const auto gathers = [&](WideRootRule r) { return !plan(r).gathered.copies.empty(); };
  EXPECT_TRUE(gathers(rule));
  WideRootRule narrow = rule, too_long = rule, too_few_rereads = rule, too_few_tiles = rule;
  narrow.min_packed_rows = 24;
  too_long.max_rows = 31;
  too_few_rereads.min_reread_values = 2049;
  too_few_tiles.min_tiles = 3;
  for (const WideRootRule& r : {narrow, too_long, too_few_rereads, too_few_tiles}) {
    EXPECT_FALSE(gathers(r));
    EXPECT_EQ(plan(r).in_place, tree.levels);
  }
  const WideRootsPlan wide = plan(rule);
  EXPECT_EQ(wide.gathered.rows, 32);
  ASSERT_EQ(wide.gathered.levels.size(), 1u);
  ASSERT_EQ(wide.gathered.levels[0].size(), 1u);
  EXPECT_EQ(wide.gathered.levels[0][0].q_len, 6);
  EXPECT_EQ(wide.gathered.levels[0][0].kv_begin, 0);
  EXPECT_TRUE(wide.in_place[0].empty());        // the root was level 0's only slice
  EXPECT_EQ(wide.in_place[1], tree.levels[1]);  // the document's root stays in place
  EXPECT_EQ(wide.in_place[2], tree.levels[2]);
}

// Keys that start inside a sequence on a block boundary resolve to its later table entries.
TEST(PagedKv, TableBeginInsideASequenceOnBlockBoundaries) {
  const std::vector<int64_t> kv_begin = {0, 40, 40, 100};
  const std::vector<int64_t> table_begin = {0, 3, 3, 7};
  const int32_t table[1] = {0};
  const PagedKv paged{.table = table,
                      .block_tokens = 16,
                      .block_stride_bytes = 1024,
                      .seq_kv_begin = kv_begin,
                      .seq_table_begin = table_begin};
  EXPECT_EQ(paged.TableBegin(0), 0);
  EXPECT_EQ(paged.TableBegin(32), 2);
  EXPECT_EQ(paged.TableBegin(40), 3);
  EXPECT_EQ(paged.TableBegin(72), 5);
  EXPECT_EQ(paged.TableBegin(41), -1);
  EXPECT_EQ(paged.TableBegin(116), 8);
  EXPECT_EQ(paged.TableBegin(-16), -1);
}

}  // namespace
}  // namespace cpfill::attention
