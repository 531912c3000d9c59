// HopperKeyTile on the host (no GPU needed): which calls the Hopper kernel runs with 176-key
// tiles, by default and under each setting of CPFILL_HOPPER_KEY_TILE.
#include "attention/cuda/hopper_key_tile.h"

#include <gtest/gtest.h>

#include <vector>

namespace cpfill::attention::cuda::internal {
namespace {

struct Call {
  std::vector<SequenceSlice> slices;
  PagedKv paged;
  CudaAttentionArgs args;
};

// One slice per (queries, keys) pair, back to back; head_dim 128 unless `dim` says otherwise.
Call MakeCall(std::vector<std::pair<int64_t, int64_t>> seqs, bool causal, int dim = 128) {
  Call c;
  int64_t q = 0, k = 0;
  for (auto [nq, nk] : seqs) {
    c.slices.push_back({q, nq, k, nk});
    q += nq;
    k += nk;
  }
  c.args.shape = AttentionShape{
      .num_heads = 32, .num_kv_heads = 8, .head_dim = dim, .softmax_scale = 0.1f, .causal = causal};
  c.args.q_tokens = q;
  c.args.kv_tokens = k;
  return c;
}

// The tile for every slice of `c` with work, as the launcher asks (pointers set here: Call is
// copied).
int TileOf(Call& c, std::string_view knob) {
  c.args.slices = c.slices.data();
  c.args.num_slices = static_cast<int64_t>(c.slices.size());
  std::vector<int64_t> work;
  for (size_t i = 0; i < c.slices.size(); ++i) {
    if (c.slices[i].q_len > 0 && c.slices[i].kv_len > 0) work.push_back(static_cast<int64_t>(i));
  }
  return HopperKeyTile(c.args, work, knob);
}

TEST(HopperKeyTile, WideTilesFromThirtyTwoKKeysWithoutTheCausalMask) {
  Call at = MakeCall({{1000, kWideTileMinKeys}, {200, 50000}}, false);
  EXPECT_EQ(TileOf(at, "auto"), kHopperWideBlockN);
  Call below = MakeCall({{1000, kWideTileMinKeys - 1}}, false);
  EXPECT_EQ(TileOf(below, "auto"), kHopperBlockN);
  // One short sequence among long ones keeps the whole call on 128-key tiles...
  Call mixed = MakeCall({{1000, 40000}, {10, 100}}, false);
  EXPECT_EQ(TileOf(mixed, "auto"), kHopperBlockN);
  // ...but a slice with no queries (no work) does not count.
  Call idle = MakeCall({{1000, 40000}, {0, 100}}, false);
  EXPECT_EQ(TileOf(idle, "auto"), kHopperWideBlockN);
  Call none = MakeCall({{0, 40000}}, false);
  EXPECT_EQ(TileOf(none, "auto"), kHopperBlockN);
}

TEST(HopperKeyTile, CausalHeadDim64AndPagedKeep128EvenWhenForced) {
  for (std::string_view knob : {"auto", "176", "128"}) {
    Call causal = MakeCall({{1000, 40000}}, true);
    EXPECT_EQ(TileOf(causal, knob), kHopperBlockN) << knob;
    Call d64 = MakeCall({{1000, 40000}}, false, 64);
    EXPECT_EQ(TileOf(d64, knob), kHopperBlockN) << knob;
    Call paged = MakeCall({{1000, 40000}}, false);
    paged.paged.block_tokens = 64;
    paged.args.paged = &paged.paged;
    EXPECT_EQ(TileOf(paged, knob), kHopperBlockN) << knob;
  }
}

TEST(HopperKeyTile, TheKnobForcesEitherWhereTheKernelHasBoth) {
  Call short_keys = MakeCall({{17, 300}}, false);
  EXPECT_EQ(TileOf(short_keys, "176"), kHopperWideBlockN);
  EXPECT_EQ(TileOf(short_keys, "auto"), kHopperBlockN);
  Call long_keys = MakeCall({{1000, 65536}}, false);
  EXPECT_EQ(TileOf(long_keys, "128"), kHopperBlockN);
  EXPECT_EQ(TileOf(long_keys, "auto"), kHopperWideBlockN);
}

}  // namespace
}  // namespace cpfill::attention::cuda::internal
