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
  ASSERT_EQ(tree.first.size(), 3u);
  EXPECT_EQ(tree.first[0].q_begin, 0);
  EXPECT_EQ(tree.first[0].q_len, 4);
  EXPECT_EQ(tree.first[0].kv_begin, 0);
  EXPECT_EQ(tree.first[0].kv_len, 48);
  EXPECT_EQ(tree.first[1].kv_begin, t.pb.slices[4].kv_begin);
  EXPECT_EQ(tree.first[1].kv_len, t.pb.slices[4].kv_len);
  ASSERT_EQ(tree.second.size(), 3u);  // the fork with no rows of its own has none here
  EXPECT_EQ(tree.second[0].kv_begin, 48);
  EXPECT_EQ(tree.second[0].kv_len, 5);
  EXPECT_EQ(tree.second[2].q_begin, 3);
  EXPECT_EQ(tree.second[2].kv_begin, t.pb.slices[3].kv_begin + 48);
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
  EXPECT_EQ(none.first.size(), t.pb.slices.size());
  EXPECT_TRUE(none.second.empty());
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
