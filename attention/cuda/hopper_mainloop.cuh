// cpfill/attention/cuda/hopper_mainloop.cuh — the consumers of the Hopper attention kernel:
// warpgroups 1 and 2, 64 query rows each, over the K/V tiles the producer puts in the ring.
//
// Per tile: S = Q K^T by wgmma with both operands in shared memory; the element mask where the
// K/V thread marked the tile partly visible; the online softmax in registers; O += P V by wgmma
// with P straight from the S accumulators (bf16 A fragments, never through shared memory).
//
// Within a consumer the next tile's Q K^T is issued before this tile's P V, so the softmax of
// tile j+1 runs while the tensor cores still do P V of tile j (FlashAttention-3's
// intra-warpgroup overlap); K is released as soon as Q K^T has read it, V after P V. With
// kPingPong the two consumer warpgroups also take turns issuing their products
// (FlashAttention-3's ping-pong), so one warpgroup's softmax runs while the other's products
// keep the tensor cores busy. The loop does no global load and builds no descriptor: both
// showed up as its stalls under Nsight Compute (bench/RESULTS.md), so tile classes come from
// the K/V thread and descriptors are moved by an add.
//
//   HopperConsumer<kDim, kStages, kQBuffers, kBlockN, kPingPong>(p, sm, warpgroup)
//       .Run(G, num_items);
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_epilogue.cuh"
#include "attention/cuda/hopper_params.h"
#include "attention/cuda/hopper_ptx.cuh"
#include "attention/cuda/hopper_shared_memory.cuh"
#include "attention/cuda/hopper_tile_scheduler.cuh"

namespace cpfill::attention::cuda::internal {

// One consumer thread's registers for an item: O (head_dim columns) and S (kBlockN keys) in the
// wgmma m64 fp32 layout (this thread's rows are tile_row + lane / 4 and that + 8, its columns
// 2 (lane % 4) + {0, 1} of every 8), P as the bf16 A operand of P V, and the online softmax's
// running max (raw score) and sum per row.
//
// Field order matters to the machine code, not to the result: the compiler materialises an
// item's initial values (l = 0, m = -inf, O = 0) in reverse field order, and this order gives
// the instruction schedule that was measured (bench/RESULTS.md); another one reschedules the
// head_dim-128 consumer loop.
template <int kDim, int kBlockN>
struct ConsumerAccumulators {
  float l_row[2];
  float m_row[2];
  uint32_t p[kBlockN / 16][4];
  float s[kBlockN / 8][4];
  float o[kDim / 8][4];
};

// The item a consumer thread is working on: its Q buffer and that buffer's descriptor, and its
// slice's key positions (for the element mask).
struct ConsumerItem {
  int qb;
  uint64_t q_desc;
  const int32_t* kpos_base;
  int kv_len;
};

// One consumer thread: its place in the CTA and its shared-memory descriptors. Holds no arrays,
// so the compiler keeps every field in a register from the start; the accumulators and the
// item's query positions are locals of Run, passed by reference.
template <int kDim, int kStages, int kQBuffers, int kBlockN, bool kPingPong>
class HopperConsumer {
 public:
  using Cfg = HopperConfig<kDim, kStages, kQBuffers, kBlockN>;
  using Smem = HopperSmem<kDim, kStages, kQBuffers, kBlockN>;
  using Acc = ConsumerAccumulators<kDim, kBlockN>;
  static constexpr int kBlockM = kHopperBlockM;

  // After setmaxnreg: thread indices are read here, not carried across it.
  __device__ __forceinline__ HopperConsumer(const HopperParams& p, const Smem& sm, int warpgroup)
      : p_(p),
        sm_(sm),
        lane_(threadIdx.x % 32),
        cw_(WarpUniform(warpgroup - 1)),
        tile_row_(cw_ * 64 + (threadIdx.x / 32) % 4 * 16) {}

  // Every item of the CTA, in order, until the Q loaders publish the stop.
  __device__ __forceinline__ void Run(int G, int num_items) {
    Acc acc;
    if (kPingPong && cw_ == 1) NamedBarrierArrive(1, 256);  // consumer 0 goes first
    const uint64_t q_desc = SmemDescriptor(sm_.q + cw_ * Cfg::kQBytesPerWarpgroup, 16, 1024);
    const uint64_t k_desc = SmemDescriptor(sm_.k, 16, 1024);
    const uint64_t v_desc = SmemDescriptor(sm_.v, Cfg::kSlabBytesKv, 1024);
    int g = 0;  // tiles consumed so far by this CTA: the ring's stage and phase
    for (int n = 0;; ++n) {
      const int slot = n & 1;
      const int item_index = WarpUniform(sm_.WaitItem(n));
      if (item_index >= num_items) break;
      const HopperItem item = LocateHopperItem(p_, item_index);
      const SliceDesc sl = item.tile.slice;
      const int64_t slice_rows = sl.q_len * G;
      const int64_t row0 = static_cast<int64_t>(item.tile.m_block) * kBlockM;
      // 1. The positions of this thread's two rows, then the slot goes back to the loaders.
      const int group_id = lane_ >> 2;
      const int32_t qp[2] = {sm_.qpos[slot][tile_row_ + group_id],
                             sm_.qpos[slot][tile_row_ + group_id + 8]};
      __syncwarp();
      if (lane_ == 0) MbarArrive(sm_.ItemFree(slot));
      // 2. The item's Q.
      const int qb = n % kQBuffers;
      const uint64_t q_desc_item = DescriptorPlus(q_desc, qb * Cfg::kQBytes);
      MbarWait(sm_.QFull(qb), (n / kQBuffers) & 1);
      const ConsumerItem it{qb, q_desc_item, p_.k_pos + sl.kv_begin, static_cast<int>(sl.kv_len)};
      // 3. Its tiles, 4. its rows out.
      g += ConsumeTiles(acc, it, qp, k_desc, v_desc, g);
      StoreItemRows<kDim>(p_, item.kv_head, sl, slice_rows, row0 + tile_row_, acc.o, acc.m_row,
                          acc.l_row, lane_);
    }
  }

 private:
  // The item's tiles from ring position g on: returns how many stages it used (one for an item
  // with no visible tile). O, m and l hold the item's unnormalised result after it.
  __device__ __forceinline__ int ConsumeTiles(Acc& acc, const ConsumerItem& it,
                                              const int32_t (&qp)[2], uint64_t k_desc,
                                              uint64_t v_desc, int g) {
#pragma unroll
    for (int i = 0; i < kDim / 2; ++i) (&acc.o[0][0])[i] = 0.f;
    acc.m_row[0] = acc.m_row[1] = -INFINITY;
    acc.l_row[0] = acc.l_row[1] = 0.f;
    // A stage's info is read before its K is released: the K/V thread rewrites it for the
    // stage's next tile. Lane 0 reads it, the lane that releases K, and shuffles it to the
    // others: read by every lane, the word's reads by lanes 1-31 reach the K/V thread's next
    // write only through __syncwarp and lane 0's arrive, which racecheck does not follow
    // (it reported each such pair as a hazard).
    MbarWait(sm_.FullK(RingStage<kStages>(g)), RingPhase<kStages>(g));
    const int info = WarpUniform(lane_ == 0 ? sm_.tile_info[RingStage<kStages>(g)] : 0);
    if (info & kTileNone) {
      SkipEmptyStage(it, RingStage<kStages>(g), RingPhase<kStages>(g));
      return 1;
    }
    return ConsumeVisibleTiles(acc, it, qp, k_desc, v_desc, g, info);
  }

  // No visible key: the stage holds no data; both of its barriers are released (V after its
  // phase completed, so no arrival can run ahead into the next phase).
  __device__ __forceinline__ void SkipEmptyStage(const ConsumerItem& it, int st, uint32_t phase) {
    MbarWait(sm_.FullV(st), phase);
    __syncwarp();
    if (lane_ == 0) {
      MbarArrive(sm_.EmptyK(st));
      MbarArrive(sm_.EmptyV(st));
    }
    ReleaseQ(it);
  }

  // The pipeline over an item's visible tiles, the first one's full_k already waited for:
  //   a. first tile: Q K^T, softmax, P;
  //   b. steady state: the next tile's Q K^T and this tile's P V in flight together; the
  //      softmax of the next tile runs as soon as its S is back, while P V still runs. The loop
  //      has one shape (the last tile's P V is peeled off), so the compiler can pair every wait
  //      with its group and keep the wgmma pipeline unserialized;
  //   c. the last tile's P V.
  // Returns the number of tiles.
  __device__ __forceinline__ int ConsumeVisibleTiles(Acc& acc, const ConsumerItem& it,
                                                     const int32_t (&qp)[2], uint64_t k_desc,
                                                     uint64_t v_desc, int g, int info) {
    auto stage = [&](int i) { return RingStage<kStages>(g + i); };
    auto phase = [&](int i) { return RingPhase<kStages>(g + i); };
    // a.
    TurnBegin();
    IssueQk(acc, it.q_desc, k_desc, stage(0));
    TurnEnd();
    WgmmaWait<0>();
    FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(acc.s[0][0]));
    __syncwarp();
    if (lane_ == 0) MbarArrive(sm_.EmptyK(stage(0)));
    if (info & kTileLast) ReleaseQ(it);
    if (info & kTileMasked) MaskTile(acc, it, qp, info & kTileIndex);
    float alpha[2];
    Softmax(acc, alpha);
    PackP(acc);
    // b.
    int i = 0;
    while (!(info & kTileLast)) {
      const int st = stage(i), st_next = stage(i + 1);
      MbarWait(sm_.FullK(st_next), phase(i + 1));
      const int info_next = WarpUniform(lane_ == 0 ? sm_.tile_info[st_next] : 0);
      TurnBegin();
      IssueQk(acc, it.q_desc, k_desc, st_next);
      MbarWait(sm_.FullV(st), phase(i));
      IssuePv(acc, v_desc, st);
      TurnEnd();
      WgmmaWait<1>();  // S of the next tile is ready; P V may still run
      FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(acc.s[0][0]));
      __syncwarp();
      if (lane_ == 0) MbarArrive(sm_.EmptyK(st_next));
      if (info_next & kTileLast) ReleaseQ(it);  // that was the item's last Q K^T
      if (info_next & kTileMasked) MaskTile(acc, it, qp, info_next & kTileIndex);
      Softmax(acc, alpha);
      WgmmaWait<0>();
      FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(acc.o[0][0]));
      __syncwarp();
      if (lane_ == 0) MbarArrive(sm_.EmptyV(st));
      RescaleO(acc, alpha);  // the next tile's alpha
      PackP(acc);
      info = info_next;
      ++i;
    }
    // c.
    const int st = stage(i);
    MbarWait(sm_.FullV(st), phase(i));
    TurnBegin();
    IssuePv(acc, v_desc, st);
    TurnEnd();
    WgmmaWait<0>();
    FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(acc.o[0][0]));
    __syncwarp();
    if (lane_ == 0) MbarArrive(sm_.EmptyV(st));
    return i + 1;
  }

  // Turns at the tensor cores: consumer c waits on named barrier 1 + c, then hands the turn
  // over. Both consumers take the same number of turns per item, so the order holds across
  // items.
  __device__ __forceinline__ void TurnBegin() {
    if constexpr (kPingPong) NamedBarrierSync(1 + cw_, 256);
  }
  __device__ __forceinline__ void TurnEnd() {
    if constexpr (kPingPong) NamedBarrierArrive(1 + (cw_ ^ 1), 256);
  }

  // This warp is done reading Q for the item: once all 8 are, the loaders may replace it.
  __device__ __forceinline__ void ReleaseQ(const ConsumerItem& it) {
    __syncwarp();
    if (lane_ == 0) MbarArrive(sm_.QEmpty(it.qb));
  }

  // S = Q K^T over head_dim in k-steps of 16: step kk is bytes 32 (kk % 4) of slab kk / 4.
  __device__ __forceinline__ void IssueQk(Acc& acc, uint64_t q_desc, uint64_t k_desc, int st) {
    const uint64_t k_tile = DescriptorPlus(k_desc, st * Cfg::kTileBytes);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const uint32_t off_q = (kk / 4) * Cfg::kSlabBytesQ + (kk % 4) * 32;
      const uint32_t off_k = (kk / 4) * Cfg::kSlabBytesKv + (kk % 4) * 32;
      WgmmaSS<kBlockN>(reinterpret_cast<float(&)[kBlockN / 2]>(acc.s[0][0]),
                       DescriptorPlus(q_desc, off_q), DescriptorPlus(k_tile, off_k),
                       kk > 0 ? 1 : 0);
    }
    WgmmaCommit();
  }

  // O += P V over the tile's keys in k-steps of 16: step kk is rows 16 kk, 2048 bytes on.
  __device__ __forceinline__ void IssuePv(Acc& acc, uint64_t v_desc, int st) {
    const uint64_t v_tile = DescriptorPlus(v_desc, st * Cfg::kTileBytes);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t desc = DescriptorPlus(v_tile, kk * 16 * 128);
      if constexpr (kDim == 128) {
        WgmmaRS_N128(reinterpret_cast<float(&)[64]>(acc.o[0][0]), acc.p[kk], desc);
      } else {
        WgmmaRS_N64(reinterpret_cast<float(&)[32]>(acc.o[0][0]), acc.p[kk], desc);
      }
    }
    WgmmaCommit();
  }

  // The element mask on a partly visible tile j: key validity, padding, causality.
  __device__ __forceinline__ void MaskTile(Acc& acc, const ConsumerItem& it, const int32_t (&qp)[2],
                                           int j) {
    const int tig = lane_ & 3;
    const int key0 = j * kBlockN;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = key0 + nt * 8 + tig * 2 + e;
        const int32_t kp = c < it.kv_len ? __ldg(it.kpos_base + c) : -1;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!(kp >= 0 && qp[h] >= 0 && (!p_.causal || kp <= qp[h]))) {
            acc.s[nt][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  }

  // Online softmax on S (FlashAttention-2's, as the mma.sync kernel): each row's alpha. Both
  // rows at once, and each row's max and sum as four independent partial chains: one chain of
  // 32 dependent operations per row left the warp waiting on every result (the softmax runs
  // while the other warpgroup has the tensor cores, so its latency is what must be hidden).
  __device__ __forceinline__ void Softmax(Acc& acc, float (&alpha)[2]) {
    constexpr int kChains = 4;
    float part[2][kChains];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[h][c] = fmaxf(acc.s[c][2 * h], acc.s[c][2 * h + 1]);
    }
#pragma unroll
    for (int nt = kChains; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        part[h][nt % kChains] =
            fmaxf(part[h][nt % kChains], fmaxf(acc.s[nt][2 * h], acc.s[nt][2 * h + 1]));
      }
    }
    float mx[2], m_scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] =
          fmaxf(fmaxf(part[h][0], part[h][1]), fmaxf(part[h][2], fmaxf(part[h][3], acc.m_row[h])));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_scaled[h] = mx[h] == -INFINITY ? 0.f : mx[h] * p_.scale_log2;
      alpha[h] = FastExp2(acc.m_row[h] * p_.scale_log2 - m_scaled[h]);
      acc.m_row[h] = mx[h];
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[h][c] = 0.f;
    }
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& a = acc.s[nt][2 * h];
        float& b = acc.s[nt][2 * h + 1];
        a = FastExp2(fmaf(a, p_.scale_log2, -m_scaled[h]));
        b = FastExp2(fmaf(b, p_.scale_log2, -m_scaled[h]));
        part[h][nt % kChains] += a + b;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc.l_row[h] =
          acc.l_row[h] * alpha[h] + ((part[h][0] + part[h][1]) + (part[h][2] + part[h][3]));
    }
  }

  __device__ __forceinline__ void RescaleO(Acc& acc, const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < kDim / 8; ++dt) {
      acc.o[dt][0] *= alpha[0];
      acc.o[dt][1] *= alpha[0];
      acc.o[dt][2] *= alpha[1];
      acc.o[dt][3] *= alpha[1];
    }
  }

  // P (the softmax's S) as the bf16 A fragments of P V: k-step kk is S columns 16 kk .. + 15.
  __device__ __forceinline__ void PackP(Acc& acc) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      acc.p[kk][0] = PackBf16(acc.s[2 * kk][0], acc.s[2 * kk][1]);
      acc.p[kk][1] = PackBf16(acc.s[2 * kk][2], acc.s[2 * kk][3]);
      acc.p[kk][2] = PackBf16(acc.s[2 * kk + 1][0], acc.s[2 * kk + 1][1]);
      acc.p[kk][3] = PackBf16(acc.s[2 * kk + 1][2], acc.s[2 * kk + 1][3]);
    }
  }

  const HopperParams& p_;
  const Smem& sm_;
  const int lane_;
  const int cw_;        // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int tile_row_;  // the warp's 16 rows: tile_row .. tile_row + 15
};

}  // namespace cpfill::attention::cuda::internal
