// PlanKeySplit on the host (no GPU needed): which calls split, into how many parts, and that the
// parts' slices cover each slice's keys exactly, in whole 128-key tiles (with paged K/V, whole
// tiles that are also whole blocks), none empty.
#include "attention/cuda/key_split.h"

#include <gtest/gtest.h>

#include <vector>

#include "attention/cuda/test_call.h"

namespace cpfill::attention::cuda::internal {
namespace {

constexpr int kH100Sms = 132;

// Every part holds a non-empty share of each slice's keys starting a multiple of `unit` keys
// into it, the shares of a slice tile its keys in order, and each part's rows land at
// part * q_tokens + q_begin.
void ExpectPartsCoverTheKeys(const Call& c, const KeySplit& split, int64_t unit = 128) {
  const size_t n = c.slices.size();
  ASSERT_EQ(split.slices.size(), n * split.parts);
  ASSERT_EQ(split.out_rows.size(), split.slices.size());
  for (size_t i = 0; i < n; ++i) {
    int64_t next = c.slices[i].kv_begin;
    for (int p = 0; p < split.parts; ++p) {
      const SequenceSlice& s = split.slices[p * n + i];
      EXPECT_EQ(s.q_begin, c.slices[i].q_begin);
      EXPECT_EQ(s.q_len, c.slices[i].q_len);
      EXPECT_EQ(s.kv_begin, next) << "slice " << i << " part " << p;
      EXPECT_GT(s.kv_len, 0) << "slice " << i << " part " << p;
      EXPECT_EQ((s.kv_begin - c.slices[i].kv_begin) % unit, 0) << "slice " << i << " part " << p;
      EXPECT_EQ(split.out_rows[p * n + i], p * c.args.q_tokens + c.slices[i].q_begin);
      next = s.kv_begin + s.kv_len;
    }
    EXPECT_EQ(next, c.slices[i].kv_begin + c.slices[i].kv_len) << "slice " << i;
  }
}

TEST(KeySplit, ShortSuffixAfterLongPrefixFillsTheGpu) {
  // 256 queries after 4K at 8:1: 16 items; 8 parts make 128 of 132 SMs.
  const Call a = MakeCall(8, 1, {{256, 4352}});
  const KeySplit split = PlanKeySplit(a.args, kH100Sms);
  EXPECT_EQ(split.parts, 8);
  ExpectPartsCoverTheKeys(a, split);
  // 32:8 after 1K: 64 items, two parts.
  const Call b = MakeCall(32, 8, {{256, 1280}});
  EXPECT_EQ(PlanKeySplit(b.args, kH100Sms).parts, 2);
  ExpectPartsCoverTheKeys(b, PlanKeySplit(b.args, kH100Sms));
}

TEST(KeySplit, SeveralSequencesShareTheParts) {
  // 10 items at 8:1; keys of 3000, 700 (6 tiles: at most 3 parts of 2) and 1024 + 17.
  const Call c = MakeCall(8, 1, {{100, 3000}, {17, 700}, {5, 1041}});
  const KeySplit split = PlanKeySplit(c.args, kH100Sms);
  EXPECT_EQ(split.parts, 3);
  ExpectPartsCoverTheKeys(c, split);
}

TEST(KeySplit, CallsThatStayWhole) {
  // Enough items for half the GPU.
  EXPECT_EQ(
      PlanKeySplit(
          MakeCall(8, 1, {{2048, 4096}, {2048, 4096}, {2048, 4096}, {2048, 4096}, {2048, 4096}})
              .args,
          kH100Sms)
          .parts,
      1);
  // Too few keys for two parts of two tiles.
  EXPECT_EQ(PlanKeySplit(MakeCall(8, 1, {{256, 300}}).args, kH100Sms).parts, 1);
  Call c = MakeCall(8, 1, {{256, 4352}});
  // The running merge cannot take the parts' merge in place.
  c.args.output = OutputMode::kMergeIntoFloat32;
  EXPECT_EQ(PlanKeySplit(c.args, kH100Sms).parts, 1);
  c.args.output = OutputMode::kFloat32;
  EXPECT_GT(PlanKeySplit(c.args, kH100Sms).parts, 1);
  // A query row in no slice: the merge would overwrite its empty row.
  c.args.q_tokens += 1;
  EXPECT_EQ(PlanKeySplit(c.args, kH100Sms).parts, 1);
}

TEST(KeySplit, PagedPartsStartOnBlocks) {
  // 256 queries after 16K at 8:1 (16 items, 8 parts) in blocks of 64, 256 and 96 tokens: parts
  // of whole 128-key tiles that are whole blocks (128, 256 and 384 keys).
  Call c = MakeCall(8, 1, {{256, 16640}});
  for (const auto& [block, unit] : {std::pair{64, 128}, {256, 256}, {96, 384}}) {
    SCOPED_TRACE(block);
    const PagedKv paged{.block_tokens = block};
    c.args.paged = &paged;
    const KeySplit split = PlanKeySplit(c.args, kH100Sms);
    EXPECT_EQ(split.parts, 8);
    ExpectPartsCoverTheKeys(c, split, unit);
  }
  // Blocks of 1024 over 2304 keys: three units, three parts (the last one short).
  c = MakeCall(8, 1, {{256, 2304}});
  const PagedKv big{.block_tokens = 1024};
  c.args.paged = &big;
  const KeySplit split = PlanKeySplit(c.args, kH100Sms);
  EXPECT_EQ(split.parts, 3);
  ExpectPartsCoverTheKeys(c, split, 1024);
}

}  // namespace
}  // namespace cpfill::attention::cuda::internal
