#include "runtime/kv/prefix_index.h"

#include <vector>

#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

std::vector<int32_t> Seq(int n, int32_t start) {
  std::vector<int32_t> s(n);
  for (int i = 0; i < n; ++i) s[i] = start + i;
  return s;
}

TEST(PrefixIndex, LongestMatchGoesOnTokenByTokenInsideTheEntry) {
  PrefixIndex index(16);
  const std::vector<int32_t> doc = Seq(100, 0);
  index.Add("a", doc, 1);
  std::vector<int32_t> q = Seq(70, 0);
  q.push_back(-5);  // differs at 70
  auto m = index.Longest(q, static_cast<int64_t>(q.size()) - 1, 2);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->entry, "a");
  EXPECT_EQ(m->tokens, 70);
  // The limit caps it (a prefill needs one token of its own).
  m = index.Longest(doc, 99, 3);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tokens, 99);
  // Less than one full block shared: no match; another first token: none.
  EXPECT_FALSE(index.Longest(Seq(15, 0), 14, 4).has_value());
  EXPECT_FALSE(index.Longest(Seq(40, 1), 39, 4).has_value());
}

TEST(PrefixIndex, NewBlocksAndRemovalAndLru) {
  PrefixIndex index(16);
  index.Add("a", Seq(64, 0), 1);
  EXPECT_EQ(index.NewBlocks(Seq(64, 0)), 0);
  EXPECT_EQ(index.NewBlocks(Seq(80, 0)), 1);
  EXPECT_EQ(index.NewBlocks(Seq(80, 7)), 5);
  std::vector<int32_t> longer = Seq(96, 0);
  index.Add("b", longer, 2);
  EXPECT_EQ(index.entries(), 2);
  EXPECT_EQ(index.tokens(), 64 + 96);
  // The newest holder answers a prefix both hold; a longer query only "b".
  EXPECT_EQ(index.Longest(Seq(50, 0), 49, 3)->entry, "b");
  EXPECT_EQ((std::vector<std::string>{"a", "b"}), index.LeastRecentlyUsedFirst());
  index.Remove("b");
  auto m = index.Longest(longer, 95, 4);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->entry, "a");
  EXPECT_EQ(m->tokens, 64);
  index.Remove("a");
  index.Remove("a");  // unknown: nothing
  EXPECT_FALSE(index.Longest(longer, 95, 5).has_value());
  EXPECT_EQ(index.NewBlocks(longer), 6);
}

TEST(PrefixIndex, SharedBlockTokensRoundsDown) {
  PrefixIndex index(16);
  std::vector<int32_t> a = Seq(60, 0), b = Seq(60, 0);
  b[40] = -1;
  EXPECT_EQ(index.SharedBlockTokens(a, b), 32);
  EXPECT_EQ(index.SharedBlockTokens(a, a), 48);
  EXPECT_EQ(index.SharedBlockTokens(a, Seq(10, 0)), 0);
}

}  // namespace
}  // namespace cpfill::runtime
