// HopperKeyTile on the host (no GPU needed): which calls the Hopper kernel runs with 176-key
// tiles, by default and under each setting of CPFILL_HOPPER_KEY_TILE.
#include "attention/cuda/hopper_key_tile.h"

#include <gtest/gtest.h>

#include <string_view>
#include <utility>
#include <vector>

#include "attention/cuda/test_call.h"

namespace cpfill::attention::cuda::internal {
namespace {

// The tile for the working slices of `c` (those with queries and keys), as the launcher asks.
int TileOf(const Call& c, std::string_view knob) {
  std::vector<int64_t> work;
  for (size_t i = 0; i < c.slices.size(); ++i) {
    if (c.slices[i].q_len > 0 && c.slices[i].kv_len > 0) work.push_back(static_cast<int64_t>(i));
  }
  return HopperKeyTile(c.args, work, knob);
}

// Without the causal mask, 32 query heads over 8 KV heads.
Call NotCausal(const std::vector<std::pair<int64_t, int64_t>>& seqs, int head_dim = 128) {
  return MakeCall(32, 8, seqs, false, head_dim);
}

TEST(HopperKeyTile, WideTilesFromThirtyTwoKKeysWithoutTheCausalMask) {
  Call at = NotCausal({{1000, kWideTileMinKeys}, {200, 50000}});
  EXPECT_EQ(TileOf(at, "auto"), kHopperWideBlockN);
  Call below = NotCausal({{1000, kWideTileMinKeys - 1}});
  EXPECT_EQ(TileOf(below, "auto"), kHopperBlockN);
  // One short sequence among long ones keeps the whole call on 128-key tiles...
  Call mixed = NotCausal({{1000, 40000}, {10, 100}});
  EXPECT_EQ(TileOf(mixed, "auto"), kHopperBlockN);
  // ...but a slice with no queries (no work) does not count.
  Call idle = NotCausal({{1000, 40000}, {0, 100}});
  EXPECT_EQ(TileOf(idle, "auto"), kHopperWideBlockN);
  Call none = NotCausal({{0, 40000}});
  EXPECT_EQ(TileOf(none, "auto"), kHopperBlockN);
}

TEST(HopperKeyTile, CausalHeadDim64AndPagedKeep128EvenWhenForced) {
  for (std::string_view knob : {"auto", "176", "128"}) {
    Call causal = MakeCall(32, 8, {{1000, 40000}});
    EXPECT_EQ(TileOf(causal, knob), kHopperBlockN) << knob;
    Call d64 = NotCausal({{1000, 40000}}, 64);
    EXPECT_EQ(TileOf(d64, knob), kHopperBlockN) << knob;
    Call paged = NotCausal({{1000, 40000}});
    PagedKv pool{.block_tokens = 64};
    paged.args.paged = &pool;
    EXPECT_EQ(TileOf(paged, knob), kHopperBlockN) << knob;
  }
}

TEST(HopperKeyTile, TheKnobForcesEitherWhereTheKernelHasBoth) {
  Call short_keys = NotCausal({{17, 300}});
  EXPECT_EQ(TileOf(short_keys, "176"), kHopperWideBlockN);
  EXPECT_EQ(TileOf(short_keys, "auto"), kHopperBlockN);
  Call long_keys = NotCausal({{1000, 65536}});
  EXPECT_EQ(TileOf(long_keys, "128"), kHopperBlockN);
  EXPECT_EQ(TileOf(long_keys, "auto"), kHopperWideBlockN);
}

}  // namespace
}  // namespace cpfill::attention::cuda::internal
