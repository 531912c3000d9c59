// cpfill/attention/cuda/hopper_params.h — what the Hopper (sm_90a) attention kernel is given and
// the fixed shape it runs with: the launch parameters, the block and register constants, and the
// dynamic shared-memory layout. Host and device code both read it; it holds no device code.
//
//   HopperParams p{};                                   // host: filled by the launcher
//   using Cfg = HopperConfig<128, kHopperStages, 2, kHopperBlockN>;  // d128, two Q buffers
//   kernel<<<ctas, kHopperThreads, Cfg::kSmemBytes, stream>>>(p);
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_key_tile.h"

namespace cpfill::attention::cuda::internal {

inline constexpr int kMaxHopperSlices = 48;

// Launch parameters; the tensor maps must live in parameter space (or global memory) for TMA,
// and 48 slices of them need the large kernel-parameter space of CUDA 12.1+.
struct HopperParams : LaunchCommon {
  // Per slice: [kv_len rows, num_kv_heads * head_dim]; with paged K/V, its last block's valid
  // rows [kv_len - its first key, num_kv_heads * head_dim] (rows past them read as zeros), or
  // where its last tile's rows are consecutive in the pool (tail_runs), that tile's valid rows
  // in boxes of kHopperBlockN.
  CUtensorMap k_maps[kMaxHopperSlices];
  CUtensorMap v_maps[kMaxHopperSlices];
  SliceDesc slices[kMaxHopperSlices];
  int32_t num_q_tiles;    // work items: num_q_tiles x num_kv_heads
  int32_t* item_counter;  // the scheduler's next free item past the first wave, or null for
                          // the static schedule (CTA b takes b, b + grid, ...)
  int32_t first_wave;     // the items the launch's CTAs take by their index (its grid size)
  int32_t joining;        // 1: a grid that joins a running launch (the same items and counter)
                          // once an exchange beside it has ended; it takes every item from the
                          // counter
  // Paged K/V (attention.h's PagedKv), or block_table null: each pool as rows
  // [pool blocks * block_tokens][num_kv_heads * head_dim] (a block's rows are contiguous,
  // HopperReadsPagedKv); a slice's key r lies in block block_table[table_begin + r /
  // block_tokens]. A key tile whose rows are consecutive pool rows (its blocks consecutive, none
  // the slice's last) loads as one box of kHopperBlockN rows (the run maps), as a contiguous
  // slice's does; any other loads in parts of box_rows keys (gcd(block_tokens, kHopperBlockN)),
  // each inside one block (the pool maps).
  CUtensorMap k_pool_map;
  CUtensorMap v_pool_map;
  CUtensorMap k_run_map;
  CUtensorMap v_run_map;
  const int32_t* block_table;
  int32_t block_tokens;
  int32_t box_rows;
  uint64_t tail_runs;  // bit i: slice i's map is over its last tile (its rows consecutive)
};
static_assert(sizeof(HopperParams) <= 32764, "kernel parameters must fit 32764 bytes");
static_assert(kMaxHopperSlices <= 64, "tail_runs holds a bit per slice");

// ---- the CTA's shape --------------------------------------------------------------------

inline constexpr int kHopperBlockM = 128;  // 2 consumer warpgroups x 64 rows
// Keys per K/V tile: kHopperBlockN (128) or kHopperWideBlockN (176), hopper_key_tile.h.
inline constexpr int kHopperThreads = 384;  // warpgroup 0: producer; 1 and 2: consumers
// Two K/V stages: a third was measured 0.5-2% slower (bench/RESULTS.md), and its shared memory
// now holds the second Q buffer.
inline constexpr int kHopperStages = 2;
// Producer warps 1-3 (the Q loaders) and the named barrier they meet at; named barriers 1 and 2
// are the consumers' turns at the tensor cores (hopper_mainloop.cuh), 0 is __syncthreads.
inline constexpr int kLoaderThreads = 96;
inline constexpr int kLoaderBarrier = 3;

// Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 = 64512 of the SM's 65536. The
// producer needs 56 (not the 24 of a TMA-only producer): its warps 1-3 walk the work items and
// compute the gather addresses of the next item's Q rows, and at 40 or 48 ptxas spilled them to
// local memory; the consumers fit 224 with no spill at 128-key tiles (at 176 keys ptxas spills
// 40 bytes: the row sums and one more value, stored and loaded once a tile; at 232 registers it
// spilled more).
inline constexpr int kProducerRegisters = 56;
inline constexpr int kConsumerRegisters = 224;

// A K/V stage's tile info word (written by the K/V thread, read by the consumers): the key
// tile's index in its slice in the low bits, and three flags.
inline constexpr int kTileMasked = 1 << 30;  // partly visible: the element mask applies
inline constexpr int kTileLast = 1 << 29;    // the item's last visible tile
inline constexpr int kTileNone = 1 << 28;    // the item has no visible tile: the stage is empty
inline constexpr int kTileIndex = kTileNone - 1;

// The dynamic shared memory, all tiles bf16 in the 128-byte swizzle (hopper_kernel.cuh's file
// comment), in this order from the 1024-byte-aligned base:
//   Q: kQBuffers x kQBytes          [buffer][consumer warpgroup][slab][64 rows][128 bytes]
//   K: kStages x kTileBytes         [stage][slab][kBlockN keys][128 bytes]
//   V: kStages x kTileBytes         [stage][slab][kBlockN keys][128 bytes]
// head_dim 128: Q 2 x 32 KiB, K and V 2 x 32 KiB each, 193 KiB with the alignment slack; with
// 176-key tiles, Q 32 KiB, K and V 2 x 44 KiB each, 209 KiB.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
struct HopperConfig {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "a key tile is wgmma's N and its k-steps");
  static constexpr int kSlabs = kDim / 64;            // 128-byte-wide column slabs
  static constexpr int kSlabBytesQ = 64 * 128;        // 64 rows of one consumer
  static constexpr int kSlabBytesKv = kBlockN * 128;  // kBlockN keys
  static constexpr int kQBytesPerWarpgroup = kSlabs * kSlabBytesQ;
  static constexpr int kQBytes = 2 * kQBytesPerWarpgroup;
  static constexpr int kTileBytes = kSlabs * kSlabBytesKv;  // one K or V tile
  // + 1024: the dynamic buffer is re-aligned to the 1024-byte swizzle period at run time.
  static constexpr int kSmemBytes = kQBuffers * kQBytes + 2 * kStages * kTileBytes + 1024;
  // 227 KiB per block on sm_90, less about 1.2 KiB of static barriers and positions.
  static_assert(kSmemBytes <= 227 * 1024 - 2048, "K/V stages exceed shared memory");
};

}  // namespace cpfill::attention::cuda::internal
