// cpfill/attention/cuda/hopper_kernel.cuh — the Hopper (sm_90a) partial-attention kernel: TMA
// loads into an mbarrier pipeline, wgmma for both products, warp-specialized warpgroups.
//
// Same contract as the mma.sync kernel (mma_kernel.cuh): fused varseq slices, per-token global
// positions, GQA folded into the M tile, three output modes, the key-tile summaries of the
// pre-pass; only how the work is done differs. A persistent CTA (one per SM) takes work items
// (one (slice, kv head, query tile of 128 folded rows) each) in turn, with 3 warpgroups. The
// parts, one file each:
//
//   hopper_params.h           parameters, CTA shape, shared-memory sizes
//   hopper_shared_memory.cuh  the CTA's shared memory: barriers, item slots, Q/K/V buffers
//   hopper_tile_scheduler.cuh work items: order, grid size, which item a CTA takes next
//   hopper_producer.cuh       warpgroup 0: item slots, Q loads, TMA K/V loads
//   hopper_mainloop.cuh       warpgroups 1-2: Q K^T, online softmax, P V, ping-pong
//   hopper_epilogue.cuh       normalise, write or merge O and LSE
//   hopper_ptx.cuh            the sm_90a instructions (mbarrier, TMA, wgmma, setmaxnreg)
//   flash_common.cuh          shared with the mma.sync kernel: launch layout, pre-pass,
//                             key-tile visibility, query tiles, StoreRows16
//
// Item n's slot (n & 1) holds its index, query positions and position range. The Q loaders fill
// it as soon as item n - 2's readers have released it (the K/V thread and the 8 consumer warps
// each arrive on item_free once they have read it); so the K/V thread learns item n + 1's
// visible tiles while the consumers still work on item n, and a short item pays no cold
// pipeline fill. With one Q buffer, item n + 1's Q loads start once the consumers' last Q K^T of
// item n has read Q, i.e. during the last P V and the epilogue; with two they run an item ahead.
//
// The K/V tensor maps are made per slice (base = the slice's first key row, height = its key
// count), so rows past a slice are zero-filled by the copy engine, never read from a neighbour
// (a persistent KV cache may hold anything there, NaN included).
//
// Shared-memory tiles use the 128-byte swizzle that TMA writes and wgmma reads: a row of 64 bf16
// is 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r & 7) of its 1024-byte group.
// A head_dim-128 tile is two such 64-column slabs, one after the other.
#pragma once

#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_mainloop.cuh"
#include "attention/cuda/hopper_params.h"
#include "attention/cuda/hopper_producer.cuh"
#include "attention/cuda/hopper_ptx.cuh"
#include "attention/cuda/hopper_shared_memory.cuh"

namespace cpfill::attention::cuda::internal {

// kPingPong: the consumer warpgroups take turns at the tensor cores (hopper_mainloop.cuh).
template <int kDim, int kStages, int kQBuffers, int kBlockN, bool kPingPong>
__global__ void __launch_bounds__(kHopperThreads, 1)
    HopperFlashKernel(const __grid_constant__ HopperParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = HopperSmem<kDim, kStages, kQBuffers, kBlockN>;
  // Layouts and barrier protocol: hopper_shared_memory.cuh.
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[Smem::kNumBarriers];
  __shared__ int32_t s_item[2];
  __shared__ int32_t s_tile_info[kStages];
  __shared__ int32_t s_qpos[2][kHopperBlockM];
  __shared__ int32_t s_qstat[2][3][3];
  const Smem sm(bars, s_item, s_tile_info, s_qpos, s_qstat, SmemAddr(smem_raw));

  // Thread indices are read again after each setmaxnreg: a value live across it is spilled.
  const int warpgroup = threadIdx.x / 128;
  const int G = p.group;
  const int num_items = p.num_q_tiles * p.num_kv_heads;

  if (threadIdx.x == 0) sm.InitBarriers();
  // Launched as a dependent of the key-tile pre-pass (pdl.cuh): the barriers are set up while it
  // runs; nothing global is read before it has finished. What follows (a merge of key parts) may
  // be placed as soon as this grid has started.
  WaitForPrecedingGrids();
  LetDependentsLaunch();
  __syncthreads();

  if (warpgroup == 0) {
    SetMaxRegistersDec<kProducerRegisters>();
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (warp == 0) {
      if (lane != 0) return;
      RunKvLoads(p, sm, num_items);  // one thread
      return;
    }
    RunQLoaders(p, sm, G, num_items, tid, warp, lane);
    return;
  }
  SetMaxRegistersInc<kConsumerRegisters>();
  HopperConsumer<kDim, kStages, kQBuffers, kBlockN, kPingPong>(p, sm, warpgroup).Run(G, num_items);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace cpfill::attention::cuda::internal
