// cpfill/attention/cuda/hopper_shared_memory.cuh — one Hopper attention CTA's shared memory: the
// mbarriers of its pipelines (who arrives on each, how many), the item slots that hand a work
// item from the Q loaders to the K/V thread and the consumers, and the dynamic Q/K/V buffers.
//
// The kernel declares the arrays (static __shared__ storage must be declared in a function) and
// hands every part one HopperSmem that names them:
//
//   __shared__ __align__(8) uint64_t bars[Smem::kNumBarriers];  ...
//   const Smem sm{bars, s_item, s_tile_info, s_qpos, s_qstat, SmemAddr(smem_raw)};
//   MbarWait(sm.FullK(st), phase);
#pragma once

#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_params.h"
#include "attention/cuda/hopper_ptx.cuh"

namespace cpfill::attention::cuda::internal {

// The barriers, in `bars` in this order (8 bytes each):
//
//   barrier             count  arrivals, per phase                          phase = use number
//   full_k[kStages]     1      the K/V thread's arrive.expect_tx, then the  tile g / kStages
//   full_v[kStages]            TMA bytes of the tile (0 for an empty stage)
//   empty_k[kStages]    8      each consumer warp, once it has read the     tile g / kStages
//   empty_v[kStages]           stage (K after Q K^T, V after P V)
//   q_full[kQBuffers]   96     each loader thread, after its cp.async landed  item n / kQBuffers
//   q_empty[kQBuffers]  8      each consumer warp, after its item's last Q K^T
//   item_ready[2]       96     each loader thread, after writing slot n & 1   item n / 2
//   item_free[2]        9      the 8 consumer warps and the K/V thread,       item n / 2
//                              once they have read slot n & 1
//
// Tile g is the CTA's g-th K/V tile (counted over all its items), in stage g % kStages; item n
// is the CTA's n-th work item, its Q in buffer n % kQBuffers.
//
// The other static arrays:
//   item[2]               [slot] the item's index; num_items or more: stop
//   tile_info[kStages]    [stage] the key tile it holds with kTileMasked/kTileLast/kTileNone;
//                         written by the K/V thread before it arrives on the stage's full_k, so
//                         the consumers learn the tile's class from shared memory instead of a
//                         chain of global loads of the summaries
//   qpos[2][kBlockM]      [slot][row] each query row's position; -1: padding or past the slice
//   qstat[2][3][3]        [slot][loader warp][min position, max position, any padding]
//
// Dynamic buffers (HopperConfig, hopper_params.h): q, k and v are their shared-space addresses.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
struct HopperSmem {
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
  static constexpr int kNumBarriers = 4 * kStages + 2 * kQBuffers + 4;

  int32_t* item;
  int32_t* tile_info;
  int32_t (*qpos)[kHopperBlockM];
  int32_t (*qstat)[3][3];
  uint32_t q, k, v;
  uint32_t bars_addr;  // shared-space address of bars[0]: a barrier's is one add from it

  // The dynamic buffer re-aligned to the 1024-byte swizzle period, then Q, K, V.
  __device__ __forceinline__ HopperSmem(uint64_t* bars_in, int32_t* item_in, int32_t* tile_info_in,
                                        int32_t (*qpos_in)[kHopperBlockM],
                                        int32_t (*qstat_in)[3][3], uint32_t dynamic_base)
      : item(item_in),
        tile_info(tile_info_in),
        qpos(qpos_in),
        qstat(qstat_in),
        q((dynamic_base + 1023u) & ~1023u),
        k(q + kQBuffers * Cfg::kQBytes),
        v(k + kStages * Cfg::kTileBytes),
        bars_addr(SmemAddr(bars_in)) {}

  // Barrier i of `bars` (the order of the table above), by its shared-space address.
  __device__ __forceinline__ uint32_t Bar(int i) const { return bars_addr + 8u * i; }
  __device__ __forceinline__ uint32_t FullK(int st) const { return Bar(st); }
  __device__ __forceinline__ uint32_t FullV(int st) const { return Bar(kStages + st); }
  __device__ __forceinline__ uint32_t EmptyK(int st) const { return Bar(2 * kStages + st); }
  __device__ __forceinline__ uint32_t EmptyV(int st) const { return Bar(3 * kStages + st); }
  __device__ __forceinline__ uint32_t QFull(int b) const { return Bar(4 * kStages + b); }
  __device__ __forceinline__ uint32_t QEmpty(int b) const {
    return Bar(4 * kStages + kQBuffers + b);
  }
  __device__ __forceinline__ uint32_t ItemReady(int slot) const {
    return Bar(4 * kStages + 2 * kQBuffers + slot);
  }
  __device__ __forceinline__ uint32_t ItemFree(int slot) const {
    return Bar(4 * kStages + 2 * kQBuffers + 2 + slot);
  }

  // Thread 0, before the CTA's first __syncthreads: every barrier with its arrival count.
  __device__ __forceinline__ void InitBarriers() const {
    for (int st = 0; st < kStages; ++st) {
      MbarInit(FullK(st), 1);
      MbarInit(FullV(st), 1);
      MbarInit(EmptyK(st), 8);  // one arrival per consumer warp
      MbarInit(EmptyV(st), 8);
    }
    for (int b = 0; b < kQBuffers; ++b) {
      MbarInit(QFull(b), kLoaderThreads);  // every loader thread, after its own copies landed
      MbarInit(QEmpty(b), 8);              // every consumer warp, after its last Q K^T of an item
    }
    for (int slot = 0; slot < 2; ++slot) {
      MbarInit(ItemReady(slot), kLoaderThreads);  // every loader thread, after its writes
      MbarInit(ItemFree(slot), 9);  // the 8 consumer warps and the K/V thread, having read it
    }
  }

  // Item n's index once its slot is filled (num_items or more: stop).
  __device__ __forceinline__ int WaitItem(int n) const {
    MbarWait(ItemReady(n & 1), (n >> 1) & 1);
    return item[n & 1];
  }
};

// Tile g of the K/V ring (the CTA's g-th, over all its items): its stage, and the parity of the
// stage's phase that tile fills. Unsigned arithmetic (g never goes negative): a mask and a
// shift, not a signed division.
template <int kStages>
__device__ __forceinline__ int RingStage(int g) {
  return static_cast<int>(static_cast<uint32_t>(g) % kStages);
}
template <int kStages>
__device__ __forceinline__ uint32_t RingPhase(int g) {
  return (static_cast<uint32_t>(g) / kStages) & 1u;
}

}  // namespace cpfill::attention::cuda::internal
