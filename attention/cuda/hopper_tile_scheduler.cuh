// cpfill/attention/cuda/hopper_tile_scheduler.cuh — which work item a persistent Hopper CTA does
// next, and the host-side order and grid size that schedule relies on.
//
// A work item is one (query tile of kHopperBlockM folded rows, kv head). The launcher puts the
// slices longest first and sizes the grid; CTA b takes item b first, then the next free one from
// a global counter (or b + gridDim.x, b + 2 gridDim.x, ... with the static schedule), so the SMs
// finish together. With gridDim.x = num_items every CTA takes one item: the non-persistent
// schedule. An item index past the end tells every warp of the CTA to stop.
//
//   host:   order = LongestSlicesFirst(a.slices, work);  ctas = PersistentGridSize(items, sms, 0);
//   device: sm.item[slot] = ClaimItem(p, n, num_items);  item = LocateHopperItem(p, index);
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_params.h"

namespace cpfill::attention::cuda::internal {

// ---- host -------------------------------------------------------------------------------

// The slices `work` (indices into `slices`) with the longest (q_len x kv_len) first: the
// scheduler hands items out in order (within a slice the latest query tiles, the most causal
// work, come first), so a launch ends on short items and the SMs finish together. Slices never
// share query rows, so their order changes no result. Stable: equal slices keep their order.
inline std::vector<int64_t> LongestSlicesFirst(const SequenceSlice* slices,
                                               std::span<const int64_t> work) {
  std::vector<int64_t> order(work.begin(), work.end());
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const SequenceSlice &sx = slices[x], &sy = slices[y];
    return sx.q_len * sx.kv_len > sy.q_len * sy.kv_len;
  });
  return order;
}

// Persistent CTAs for `items` work items: one per free SM (its shared memory and 384 threads
// fill it), at most max_ctas when that is positive, never more than the items.
inline int PersistentGridSize(int items, int free_sms, int max_ctas) {
  int ctas = std::min(items, free_sms);
  if (max_ctas > 0) ctas = std::min(ctas, max_ctas);
  return ctas;
}

// ---- device -----------------------------------------------------------------------------

// A work item: one (query tile, kv head). Items are numbered tile-major, so the heads of one
// tile (the same positions, the same cost) are neighbours and the order is the tiles' order:
// within a slice the latest (most causal work) first.
struct HopperItem {
  QueryTile tile;
  int kv_head;
};
__device__ __forceinline__ HopperItem LocateHopperItem(const HopperParams& p, int item) {
  return {LocateQueryTile(p.slices, p.num_slices, p.group, kHopperBlockM, item / p.num_kv_heads),
          item % p.num_kv_heads};
}

// The CTA's n-th item: blockIdx.x first, then the next free one from the counter (the counter
// starts at 0 for the items past the first wave), or the static round-robin without one. A
// joining grid's CTAs take every item from the counter. num_items (stop) once the items run out.
// One thread per CTA calls it, once per n.
__device__ __forceinline__ int ClaimItem(const HopperParams& p, int n, int num_items) {
  int next = static_cast<int>(blockIdx.x);
  if (n > 0 || p.joining) {
    next = p.item_counter != nullptr
               ? p.first_wave + atomicAdd(p.item_counter, 1)
               : static_cast<int>(blockIdx.x) + n * static_cast<int>(gridDim.x);
  }
  return min(next, num_items);
}

}  // namespace cpfill::attention::cuda::internal
