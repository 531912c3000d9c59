#include "attention/cuda/hopper_key_tile.h"

#include <algorithm>

namespace cpfill::attention::cuda::internal {

// Against 128-key tiles in one call on an H200 (bench/RESULTS.md, 2026-11-28), 176-key tiles ran
// 1.01x-1.08x the speed at 32K keys, 0.99x-1.00x at 16K and 0.93x-0.97x at 4K-8K, where an
// item's tiles are few and its one Q buffer leaves each item's start exposed. Causal calls keep
// 128-key tiles, as FlashAttention-3 does (not measured here); paged K/V keeps them because its
// loads come in parts sized for them. Under a key split the parts are the slices, so their
// lengths count.
int HopperKeyTile(const CudaAttentionArgs& a, std::span<const int64_t> work,
                  std::string_view knob) {
  if (knob == "128" || a.shape.head_dim != 128 || a.shape.causal || a.paged != nullptr) {
    return kHopperBlockN;
  }
  if (knob == "176") return kHopperWideBlockN;
  const bool long_keys = !work.empty() && std::all_of(work.begin(), work.end(), [&](int64_t i) {
    return a.slices[i].kv_len >= kWideTileMinKeys;
  });
  return long_keys ? kHopperWideBlockN : kHopperBlockN;
}

}  // namespace cpfill::attention::cuda::internal
