// cpfill/attention/cuda/hopper_producer.cuh — warpgroup 0 of the Hopper attention kernel: it
// finds the work, publishes it, and fills the consumers' shared memory.
//
//   warps 1-3, the Q loaders (RunQLoaders): take the CTA's next item (hopper_tile_scheduler.cuh),
//     publish it in item slot n & 1 with its query positions and their range, then load its Q
//     tile (cp.async) into Q buffer n % kQBuffers; with two buffers the next item's Q lands
//     while the consumers work on this one.
//   one thread of warp 0, the K/V thread (RunKvLoads): issues the TMA loads of each item's
//     visible K and V tiles into the ring of kStages stages, with each tile's class in the
//     stage's tile-info word. It needs only the item slot, not Q, so it runs on into the next
//     item while the consumers still finish this one.
//
// The barriers and slots are HopperSmem's (hopper_shared_memory.cuh). Both run after the
// warpgroup gave its registers away (kProducerRegisters).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_params.h"
#include "attention/cuda/hopper_ptx.cuh"
#include "attention/cuda/hopper_shared_memory.cuh"
#include "attention/cuda/hopper_tile_scheduler.cuh"

namespace cpfill::attention::cuda::internal {

// ---- the K/V thread ---------------------------------------------------------------------

// The visible key tiles of an item, from the statistics its loaders left in slot `slot`.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ VisibleKeyTiles
ItemVisibleTiles(const HopperParams& p, const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
                 const SliceDesc& sl, int slot) {
  int32_t q_min = INT32_MAX, q_max = -1, q_pad = 0;
#pragma unroll
  for (int w = 0; w < 3; ++w) {
    q_min = min(q_min, sm.qstat[slot][w][0]);
    q_max = max(q_max, sm.qstat[slot][w][1]);
    q_pad |= sm.qstat[slot][w][2];
  }
  return VisibleKeyTiles{p.key_tiles + sl.k_tile_start,
                         static_cast<int>((sl.kv_len + kBlockN - 1) / kBlockN),
                         q_min,
                         q_max,
                         q_pad,
                         p.causal};
}

// Key tile j of the item into a stage's K or V buffer at `dst`, one TMA per 64-column slab.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void LoadKvTile(uint32_t dst, const CUtensorMap* map, int kv_head, int j,
                                           uint32_t bar) {
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
#pragma unroll
  for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
    TmaLoad2d(dst + slab * Cfg::kSlabBytesKv, map, kv_head * kDim + slab * 64, j * kBlockN, bar);
  }
}

// Paged K/V, in tiles of kHopperBlockN keys (the launcher takes no wide tile for it): a key tile
// loads as one box where its rows are consecutive in the pool (a sequence's blocks mostly are:
// the KV cache hands out the lowest free block first), else in parts of box_rows keys, each
// inside one block, at most kMaxPagedParts of them (HopperReadsPagedKv: blocks of a multiple of
// 32 tokens). Everything a tile's loads need is found a tile ahead, while
// the K/V thread waits for a free stage: after the wait it only issues them. (Computed after it,
// the block ids' loads and a 64-bit division delayed every tile's copies, and paged steps ran up
// to 1.6x slower than gathered ones.)
inline constexpr int kMaxPagedParts = 4;
struct PagedTile {
  // Each part's first row: in the pool for a whole part, else in the slice's map (past its rows
  // for a part past the slice's keys: zeros).
  int row[kMaxPagedParts];
  // The leading parts whose rows are all the slice's keys, and two flags (packed: the K/V thread
  // holds two tiles in its 56 registers).
  int whole_parts_and_flags;
  static constexpr int kRun = 8;    // all parts whole, in consecutive pool rows: one run-map box
  static constexpr int kTail = 16;  // the slice's partial last tile, its map's one box (tail_runs)
  __device__ int whole_parts() const { return whole_parts_and_flags & 7; }
  __device__ bool run() const { return (whole_parts_and_flags & kRun) != 0; }
  __device__ bool tail() const { return (whole_parts_and_flags & kTail) != 0; }
};

// Key tile j of slice `slice` (its descriptor `sl`, its last block `last` in its table): its
// parts.
__device__ __forceinline__ PagedTile PagedTileOf(const HopperParams& p, const SliceDesc& sl,
                                                 int slice, int j, int last) {
  PagedTile t;
  const int rows = p.box_rows, bt = p.block_tokens;
  int idx = j * kHopperBlockN / bt;
  int row = j * kHopperBlockN - idx * bt;
  const int keys = static_cast<int>(
      min(sl.kv_len - int64_t{j} * kHopperBlockN, static_cast<int64_t>(kHopperBlockN)));
  const int whole = keys / rows;
  bool run = keys == kHopperBlockN;
#pragma unroll
  for (int part = 0; part < kMaxPagedParts; ++part) {
    if (part * rows >= kHopperBlockN) break;
    // Pool rows fit an int: the launcher checks the pool's.
    t.row[part] = part < whole  ? __ldg(p.block_table + sl.table_begin + idx) * bt + row
                  : idx == last ? row
                                : bt;
    run = run && t.row[part] == t.row[0] + part * rows;
    row += rows;
    if (row == bt) row = 0, ++idx;
  }
  const bool tail = keys < kHopperBlockN && ((p.tail_runs >> slice) & 1) != 0;
  t.whole_parts_and_flags = whole | (run ? PagedTile::kRun : 0) | (tail ? PagedTile::kTail : 0);
  return t;
}

// A paged key tile's loads: one box of the run map where its rows are consecutive in the pool, or
// of the slice's map for a tail run; else part by part, whole parts from the pool map at their
// rows, the rest through the slice's map over its last block (its rows past the slice's keys read
// as zeros, whatever the pool holds there; parts past the slice too: that map at a row past its
// rows).
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void LoadPagedKvTile(const HopperParams& p, uint32_t dst,
                                                const CUtensorMap* pool_map,
                                                const CUtensorMap* run_map,
                                                const CUtensorMap* slice_map, const PagedTile& t,
                                                int kv_head, uint32_t bar) {
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
  if (t.run() || t.tail()) {
#pragma unroll
    for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
      const int col = kv_head * kDim + slab * 64;
      TmaLoad2d(dst + slab * Cfg::kSlabBytesKv, t.run() ? run_map : slice_map, col,
                t.run() ? t.row[0] : 0, bar);
    }
    return;
  }
  const int rows = p.box_rows;
#pragma unroll
  for (int part = 0; part < kMaxPagedParts; ++part) {
    if (part * rows >= kHopperBlockN) break;
    const uint32_t d = dst + part * rows * 128;
    const CUtensorMap* map = part < t.whole_parts() ? pool_map : slice_map;
#pragma unroll
    for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
      TmaLoad2d(d + slab * Cfg::kSlabBytesKv, map, kv_head * kDim + slab * 64, t.row[part], bar);
    }
  }
}

// Every visible tile of an item fills one stage. An item with none still fills one, with no
// data (an arrival of 0 bytes completes each barrier's phase) and kTileNone, so the consumers
// learn it from the ring and never read the summaries. `g` counts the CTA's tiles.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void LoadItemKv(const HopperParams& p,
                                           const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
                                           const HopperItem& item, const VisibleKeyTiles& tiles,
                                           int& g) {
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
  const CUtensorMap* kmap = &p.k_maps[item.tile.slice_index];
  const CUtensorMap* vmap = &p.v_maps[item.tile.slice_index];
  int j = tiles.NextVisible(0);
  const bool none = j >= tiles.num_tiles;
  const uint32_t bytes = none ? 0u : static_cast<uint32_t>(Cfg::kTileBytes);
  const bool paged = kBlockN == kHopperBlockN && !none && p.block_table != nullptr;
  const int last = paged ? static_cast<int>((item.tile.slice.kv_len - 1) / p.block_tokens) : 0;
  // A paged tile's block ids are loaded a tile ahead, while the thread waits for the stage.
  PagedTile paged_tile;
  if (paged) paged_tile = PagedTileOf(p, item.tile.slice, item.tile.slice_index, j, last);
  do {
    const int j_next = none ? j : tiles.NextVisible(j + 1);
    const int info = none ? kTileNone
                          : j | (tiles.Classify(j) == 1 ? kTileMasked : 0) |
                                (j_next >= tiles.num_tiles ? kTileLast : 0);
    const int st = RingStage<kStages>(g);
    const uint32_t free_parity = ((g / kStages) & 1) ^ 1;
    // 1. Wait until the consumers released the stage's K (its previous tile's Q K^T).
    MbarWait(sm.EmptyK(st), free_parity);
    // 2. The tile's class, released to the consumers by the arrive on full_k below.
    sm.tile_info[st] = info;
    // 3. K: expect the bytes, then the copies complete them.
    MbarArriveExpectTx(sm.FullK(st), bytes);
    if (paged) {
      LoadPagedKvTile<kDim, kStages, kQBuffers, kBlockN>(p, sm.k + st * Cfg::kTileBytes,
                                                         &p.k_pool_map, &p.k_run_map, kmap,
                                                         paged_tile, item.kv_head, sm.FullK(st));
    } else if (!none) {
      LoadKvTile<kDim, kStages, kQBuffers, kBlockN>(sm.k + st * Cfg::kTileBytes, kmap, item.kv_head,
                                                    j, sm.FullK(st));
    }
    PagedTile next_tile;
    if (paged && j_next < tiles.num_tiles)
      next_tile = PagedTileOf(p, item.tile.slice, item.tile.slice_index, j_next, last);
    // 4. V the same, once the stage's V is released (its previous tile's P V).
    MbarWait(sm.EmptyV(st), free_parity);
    MbarArriveExpectTx(sm.FullV(st), bytes);
    if (paged) {
      LoadPagedKvTile<kDim, kStages, kQBuffers, kBlockN>(p, sm.v + st * Cfg::kTileBytes,
                                                         &p.v_pool_map, &p.v_run_map, vmap,
                                                         paged_tile, item.kv_head, sm.FullV(st));
    } else if (!none) {
      LoadKvTile<kDim, kStages, kQBuffers, kBlockN>(sm.v + st * Cfg::kTileBytes, vmap, item.kv_head,
                                                    j, sm.FullV(st));
    }
    if (paged) paged_tile = next_tile;
    j = j_next;
    ++g;
  } while (!none && j < tiles.num_tiles);
}

// Lane 0 of warp 0: every item's K and V tiles, until the loaders publish the stop.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void RunKvLoads(const HopperParams& p,
                                           const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
                                           int num_items) {
  int g = 0;  // tiles issued so far by this CTA: the ring's stage and phase
  for (int n = 0;; ++n) {
    const int slot = n & 1;
    const int item_index = sm.WaitItem(n);
    if (item_index >= num_items) return;
    const HopperItem item = LocateHopperItem(p, item_index);
    const VisibleKeyTiles tiles = ItemVisibleTiles(p, sm, item.tile.slice, slot);
    MbarArrive(sm.ItemFree(slot));
    LoadItemKv(p, sm, item, tiles, g);
  }
}

// ---- the Q loaders (warps 1-3) ----------------------------------------------------------

// Each query row's position into the slot, and per loader warp the smallest and largest valid
// position and whether any row is padding (the K/V thread's tile classes come from these).
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void PublishQueryPositions(
    const HopperParams& p, const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
    const SliceDesc& sl, int G, int64_t row0, int64_t slice_rows, int slot, int t, int warp,
    int lane) {
  int32_t mn = INT32_MAX, mx = -1, pad = 0;
  for (int r = t; r < kHopperBlockM; r += kLoaderThreads) {
    const int64_t row = row0 + r;
    const bool in = row < slice_rows;
    const int32_t pos = in ? p.q_pos[sl.q_begin + row / G] : -1;
    sm.qpos[slot][r] = pos;
    if (in && pos >= 0) {
      mn = min(mn, pos);
      mx = max(mx, pos);
    }
    pad |= (in && pos < 0) ? 1 : 0;
  }
  mn = __reduce_min_sync(0xffffffffu, mn);
  mx = __reduce_max_sync(0xffffffffu, mx);
  pad = __reduce_or_sync(0xffffffffu, pad);
  if (lane == 0) {
    sm.qstat[slot][warp - 1][0] = mn;
    sm.qstat[slot][warp - 1][1] = mx;
    sm.qstat[slot][warp - 1][2] = pad;
  }
}

// The item's Q rows (folded: row r is token r / G, head kv_head G + r % G) into Q buffer qb in
// the swizzled layout; rows past the slice are zero-filled by the copy. A thread keeps one
// 16-byte column chunk and walks rows 6 apart (96 threads, 16 chunks). Issues the copies only:
// the caller waits for them.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void IssueQTileLoads(
    const HopperParams& p, const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
    const HopperItem& item, const SliceDesc& sl, int G, int64_t row0, int64_t slice_rows, int qb,
    int t) {
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
  static_assert(kLoaderThreads % (kDim / 8) == 0);
  constexpr int kRowStep = kLoaderThreads / (kDim / 8);
  const int c = t % (kDim / 8), slab = c / 8, cc = c % 8;
  const __nv_bfloat16* q_head =
      p.q + static_cast<int64_t>(item.kv_head) * G * kDim + c * 8;  // + token, + group
  const int64_t q_stride = static_cast<int64_t>(p.num_heads) * kDim;
  // Not unrolled: the loads run an item ahead, off the critical path, and unrolled the row
  // addresses outgrow the producer's 56 registers.
#pragma unroll 1
  for (int r = t / (kDim / 8); r < kHopperBlockM; r += kRowStep) {
    const int64_t row = row0 + r;
    const bool in = row < slice_rows;
    const int64_t token = sl.q_begin + row / G;
    const __nv_bfloat16* src =
        in ? q_head + token * q_stride + static_cast<int64_t>(row - (row / G) * G) * kDim : p.q;
    const int wg = r / 64, rr = r % 64;
    CpAsync16ZeroFill(sm.q + qb * Cfg::kQBytes + wg * Cfg::kQBytesPerWarpgroup +
                          slab * Cfg::kSlabBytesQ + rr * 128 + ((cc ^ (rr & 7)) << 4),
                      src, in);
  }
}

// Warps 1-3 (thread tid = warp * 32 + lane): for each of the CTA's items n, in order, until the
// scheduler runs out.
template <int kDim, int kStages, int kQBuffers, int kBlockN>
__device__ __forceinline__ void RunQLoaders(const HopperParams& p,
                                            const HopperSmem<kDim, kStages, kQBuffers, kBlockN>& sm,
                                            int G, int num_items, int tid, int warp, int lane) {
  const int t = tid - 32;
  for (int n = 0;; ++n) {
    const int slot = n & 1;
    // 1. Wait until item n - 2's readers (K/V thread, 8 consumer warps) released the slot.
    if (n >= 2) MbarWait(sm.ItemFree(slot), ((n - 2) >> 1) & 1);
    // 2. One thread claims the item; the loaders meet so all see its index.
    if (t == 0) sm.item[slot] = ClaimItem(p, n, num_items);
    NamedBarrierSync(kLoaderBarrier, kLoaderThreads);
    const int item_index = sm.item[slot];
    if (item_index >= num_items) {
      MbarArrive(sm.ItemReady(slot));  // the stop, to the K/V thread and the consumers
      return;
    }
    // 3. Publish the item's positions and their range: the K/V thread can start on its tiles.
    const HopperItem item = LocateHopperItem(p, item_index);
    const SliceDesc& sl = item.tile.slice;
    const int64_t slice_rows = sl.q_len * G;
    const int64_t row0 = static_cast<int64_t>(item.tile.m_block) * kHopperBlockM;
    PublishQueryPositions(p, sm, sl, G, row0, slice_rows, slot, t, warp, lane);
    MbarArrive(sm.ItemReady(slot));
    // 4. Wait until the consumers are done reading this buffer's last Q (item n - kQBuffers).
    const int qb = n % kQBuffers;
    if (n >= kQBuffers) MbarWait(sm.QEmpty(qb), ((n - kQBuffers) / kQBuffers) & 1);
    // 5. Q in, visible to wgmma (the async proxy), then announced.
    IssueQTileLoads(p, sm, item, sl, G, row0, slice_rows, qb, t);
    CpAsyncWaitAll();
    FenceProxyAsync();
    MbarArrive(sm.QFull(qb));
  }
}

}  // namespace cpfill::attention::cuda::internal
