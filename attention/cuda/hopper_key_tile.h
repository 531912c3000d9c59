// cpfill/attention/cuda/hopper_key_tile.h — how many keys the Hopper kernel's K/V tiles hold
// for a call: 128, or FlashAttention-3's 176 without the causal mask. Host code only: the rule
// needs no GPU, and the key split and the tests read it too.
//
//   const int block_n = HopperKeyTile(args, working_slices, knobs::Choice(kHopperKeyTile));
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "attention/cuda/attention_cuda.h"

namespace cpfill::attention::cuda::internal {

// Keys per K/V tile: 128, or 176 for calls with no causal mask at head_dim 128 on contiguous K/V
// (FlashAttention-3's non-causal tile): the per-tile costs (the O rescale, the row max and sum
// shuffles, the barriers) spread over 1.375x the keys. A 176-key tile's stages leave room for
// one Q buffer only (hopper_params.h).
inline constexpr int kHopperBlockN = 128;
inline constexpr int kHopperWideBlockN = 176;
// Where 176-key tiles run by default: every working slice has at least this many keys.
inline constexpr int64_t kWideTileMinKeys = 32768;

// The key tile for the slices `work` of `a` (indices into a.slices, each with work to do):
// kHopperWideBlockN for head_dim 128 without the causal mask on contiguous K/V where each of
// them has at least kWideTileMinKeys keys, else kHopperBlockN. `knob` (CPFILL_HOPPER_KEY_TILE)
// "128" or "176" forces either, 176 only where the kernel has it. The launcher takes no other
// way to the 176-key kernel: it cannot read paged K/V (its loads skip the pool's parts).
int HopperKeyTile(const CudaAttentionArgs& a, std::span<const int64_t> work, std::string_view knob);

}  // namespace cpfill::attention::cuda::internal
