// cpfill/attention/cuda/hopper_kernel.cuh — the Hopper (sm_90a) partial-attention kernel:
// TMA loads into an mbarrier pipeline, wgmma for both products, warp-specialized warpgroups.
//
// Same contract as flash_kernel.cuh (fused varseq slices, per-token global positions, GQA folded
// into the M tile, three output modes, the key-tile summaries of the pre-pass); this file only
// changes how the work is done:
//
//   one CTA = one (slice, kv head, query tile of 128 folded rows), 3 warpgroups:
//     warpgroup 0, the producer: gives its registers away (setmaxnreg) and one thread issues the
//       TMA loads of the visible K and V tiles (128 keys each) into a kStages-deep ring of
//       shared-memory buffers, each guarded by a "full" and an "empty" mbarrier;
//     warpgroups 1 and 2, the consumers: 64 query rows each. S = Q K^T by wgmma with both
//       operands in shared memory; the online softmax in registers; O += P V by wgmma with P
//       straight from the S accumulators (bf16 A fragments, never through shared memory).
//
// Within a consumer the next tile's Q K^T is issued before this tile's P V, so the softmax of
// tile j+1 runs while the tensor cores still do P V of tile j (FlashAttention-3's intra-warpgroup
// overlap); K is released as soon as Q K^T has read it, V after P V.
//
// The K/V tensor maps are made per slice (base = the slice's first key row, height = its key
// count), so rows past a slice are zero-filled by the copy engine, never read from a neighbour
// (a persistent KV cache may hold anything there, NaN included).
//
// Shared-memory tiles use the 128-byte swizzle that TMA writes and wgmma reads: a row of 64 bf16
// is 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r & 7) of its 1024-byte group.
// A head_dim-128 tile is two such 64-column slabs, one after the other.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "attention/cuda/flash_kernel.cuh"

namespace cpfill::attention::cuda::internal {

inline constexpr int kMaxHopperSlices = 48;

// Launch parameters; the tensor maps must live in parameter space (or global memory) for TMA,
// and 48 slices of them need the large kernel-parameter space of CUDA 12.1+.
struct HopperParams : LaunchCommon {
  CUtensorMap k_maps[kMaxHopperSlices];  // per slice: [kv_len rows, num_kv_heads * head_dim]
  CUtensorMap v_maps[kMaxHopperSlices];
  SliceDesc slices[kMaxHopperSlices];
};
static_assert(sizeof(HopperParams) <= 32764, "kernel parameters must fit 32764 bytes");

inline constexpr int kHopperBlockM = 128;  // 2 consumer warpgroups x 64 rows
inline constexpr int kHopperBlockN = 128;  // keys per K/V tile
inline constexpr int kHopperThreads = 384;

template <int kDim, int kStages>
struct HopperConfig {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kSlabs = kDim / 64;                      // 128-byte-wide column slabs
  static constexpr int kSlabBytesQ = 64 * 128;                  // 64 rows of one consumer
  static constexpr int kSlabBytesKv = kHopperBlockN * 128;      // 128 keys
  static constexpr int kQBytesPerWarpgroup = kSlabs * kSlabBytesQ;
  static constexpr int kQBytes = 2 * kQBytesPerWarpgroup;
  static constexpr int kTileBytes = kSlabs * kSlabBytesKv;      // one K or V tile
  // + 1024: the dynamic buffer is re-aligned to the 1024-byte swizzle period at run time.
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kTileBytes + 1024;
};

// ---- PTX wrappers: mbarriers, TMA, wgmma --------------------------------------------------

__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// 2-D tile load: box of the map at element coordinates (c0 inner, c1 row) into shared memory,
// completing `bytes` of the barrier's transaction count.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <int kRegs>
__device__ __forceinline__ void SetMaxRegistersDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxRegistersInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers 1 and 2 order the two consumer warpgroups' turns at the tensor cores.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma issue
// or wait: the tensor cores write them asynchronously, which the compiler cannot see.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void FenceRegisters(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
  }
}

// Shared-memory matrix descriptor, 128-byte swizzle. For K-major operands the leading offset is
// unused and the stride offset is the 1024 bytes between groups of 8 rows; for the N-major V the
// leading offset is the distance between 64-column slabs.
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t addr, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  uint64_t d = (addr & 0x3FFFF) >> 4;
  d |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  d |= uint64_t{1} << 62;  // 128-byte swizzle
  return d;
}

// Inline PTX has no loops: the operand lists are written out.
// D (64 x 128, fp32) {=, +=} A (64 x 16, smem desc) * B (16 x 128, smem desc); both K-major.
__device__ __forceinline__ void WgmmaSS_N128(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                            int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64 x 128, fp32) += A (64 x 16, bf16 registers) * B (16 x 128, smem desc, N-major).
__device__ __forceinline__ void WgmmaRS_N128(float (&d)[64], const uint32_t (&a)[4],
                                            uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D (64 x 64, fp32) += A (64 x 16, bf16 registers) * B (16 x 64, smem desc, N-major).
__device__ __forceinline__ void WgmmaRS_N64(float (&d)[32], const uint32_t (&a)[4],
                                            uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// ---- the kernel --------------------------------------------------------------------------

// kPingPong: the two consumer warpgroups take turns issuing their products (FlashAttention-3's
// ping-pong), so one warpgroup's softmax runs while the other's products keep the tensor cores
// busy.
template <int kDim, int kStages, bool kPingPong>
__global__ void __launch_bounds__(kHopperThreads, 1)
    HopperFlashKernel(const __grid_constant__ HopperParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = HopperConfig<kDim, kStages>;
  constexpr int kBlockM = kHopperBlockM, kBlockN = kHopperBlockN;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[4 * kStages];  // full K, full V, empty K, empty V
  __shared__ int32_t s_qpos[kBlockM];
  __shared__ int32_t s_qstat[4][3];
  const uint32_t smem_base = (SmemAddr(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_q = smem_base;
  const uint32_t s_k = s_q + Cfg::kQBytes;
  const uint32_t s_v = s_k + kStages * Cfg::kTileBytes;
  auto full_k = [&](int st) { return SmemAddr(&bars[st]); };
  auto full_v = [&](int st) { return SmemAddr(&bars[kStages + st]); };
  auto empty_k = [&](int st) { return SmemAddr(&bars[2 * kStages + st]); };
  auto empty_v = [&](int st) { return SmemAddr(&bars[3 * kStages + st]); };

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warpgroup = warp / 4;

  const QueryTile tile = LocateQueryTile(p.slices, p.num_slices, p.group, kBlockM);
  const SliceDesc sl = tile.slice;
  const int m_block = tile.m_block;
  const int G = p.group;
  const int64_t slice_rows = sl.q_len * G;
  const int kv_head = blockIdx.y;
  const int64_t q_stride = static_cast<int64_t>(p.num_heads) * kDim;
  const int64_t row0 = static_cast<int64_t>(m_block) * kBlockM;

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      MbarInit(full_k(st), 1);
      MbarInit(full_v(st), 1);
      MbarInit(empty_k(st), 8);  // one arrival per consumer warp
      MbarInit(empty_v(st), 8);
    }
  }

  // The Q tile, by every thread, into the swizzled layout (rows past the slice are zeros), and
  // the query positions with the tile's statistics (warps 0-3, one row each).
  for (int i = tid; i < kBlockM * (kDim / 8); i += kHopperThreads) {
    const int r = i / (kDim / 8), c = i % (kDim / 8);
    const int64_t row = row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < slice_rows) {
      const int64_t t = row / G;
      const int g = static_cast<int>(row % G);
      val = *reinterpret_cast<const uint4*>(p.q + (sl.q_begin + t) * q_stride +
                                            static_cast<int64_t>(kv_head * G + g) * kDim + c * 8);
    }
    const int wg = r / 64, rr = r % 64, slab = c / 8, cc = c % 8;
    const uint32_t dst = s_q + wg * Cfg::kQBytesPerWarpgroup + slab * Cfg::kSlabBytesQ +
                         rr * 128 + ((cc ^ (rr & 7)) << 4);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(val.x),
                 "r"(val.y), "r"(val.z), "r"(val.w)
                 : "memory");
  }
  if (tid < kBlockM) {
    const int64_t row = row0 + tid;
    const int32_t pos = row < slice_rows ? p.q_pos[sl.q_begin + row / G] : -1;
    s_qpos[tid] = pos;
    const bool in = row < slice_rows;
    int32_t mn = (in && pos >= 0) ? pos : INT32_MAX;
    int32_t mx = (in && pos >= 0) ? pos : -1;
    int32_t pad = (in && pos < 0) ? 1 : 0;
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    pad = __reduce_or_sync(0xffffffffu, pad);
    if (lane == 0) {
      s_qstat[warp][0] = mn;
      s_qstat[warp][1] = mx;
      s_qstat[warp][2] = pad;
    }
  }
  FenceProxyAsync();  // the Q stores are read by wgmma (the async proxy)
  __syncthreads();
  int32_t q_min = INT32_MAX, q_max = -1, q_pad = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    q_min = min(q_min, s_qstat[w][0]);
    q_max = max(q_max, s_qstat[w][1]);
    q_pad |= s_qstat[w][2];
  }

  // The producer and the consumers walk the same list of visible key tiles.
  const int num_k_tiles = static_cast<int>((sl.kv_len + kBlockN - 1) / kBlockN);
  const VisibleKeyTiles tiles{p.key_tiles + sl.k_tile_start, num_k_tiles, q_min, q_max, q_pad,
                              p.causal};
  auto classify = [&](int j) { return tiles.Classify(j); };
  auto next_visible = [&](int j) { return tiles.NextVisible(j); };

  if (warpgroup == 0) {
    // ---- producer ----
    SetMaxRegistersDec<24>();
    if (warp == 0 && lane == 0) {
      const CUtensorMap* kmap = &p.k_maps[tile.slice_index];
      const CUtensorMap* vmap = &p.v_maps[tile.slice_index];
      int it = 0;
      for (int j = next_visible(0); j < num_k_tiles; j = next_visible(j + 1), ++it) {
        const int st = it % kStages;
        const uint32_t free_parity = ((it / kStages) & 1) ^ 1;
        MbarWait(empty_k(st), free_parity);
        MbarArriveExpectTx(full_k(st), Cfg::kTileBytes);
#pragma unroll
        for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
          TmaLoad2d(s_k + st * Cfg::kTileBytes + slab * Cfg::kSlabBytesKv, kmap,
                    kv_head * kDim + slab * 64, j * kBlockN, full_k(st));
        }
        MbarWait(empty_v(st), free_parity);
        MbarArriveExpectTx(full_v(st), Cfg::kTileBytes);
#pragma unroll
        for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
          TmaLoad2d(s_v + st * Cfg::kTileBytes + slab * Cfg::kSlabBytesKv, vmap,
                    kv_head * kDim + slab * 64, j * kBlockN, full_v(st));
        }
      }
    }
    return;
  }

  // ---- consumers ----
  SetMaxRegistersInc<240>();
  const int cw = warpgroup - 1;        // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int wq = warp % 4;             // warp in the warpgroup: rows 16 wq .. 16 wq + 15
  const int group_id = lane >> 2, tig = lane & 3;
  const int tile_row = cw * 64 + wq * 16;
  const int32_t qp[2] = {s_qpos[tile_row + group_id], s_qpos[tile_row + group_id + 8]};
  const uint32_t q_wg = s_q + cw * Cfg::kQBytesPerWarpgroup;
  const int32_t* kpos_base = p.k_pos + sl.kv_begin;
  const int kv_len = static_cast<int>(sl.kv_len);

  float o_acc[kDim / 8][4];
  float* o_flat = &o_acc[0][0];
#pragma unroll
  for (int i = 0; i < kDim / 2; ++i) o_flat[i] = 0.f;
  float s_acc[kBlockN / 8][4];
  float* s_flat = &s_acc[0][0];
  uint32_t p_frag[kBlockN / 16][4];
  float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.f, 0.f};
  // Turns at the tensor cores: consumer c waits on barrier 1 + c, then hands the turn over.
  auto turn_begin = [&] {
    if constexpr (kPingPong) NamedBarrierSync(1 + cw, 256);
  };
  auto turn_end = [&] {
    if constexpr (kPingPong) NamedBarrierArrive(1 + (cw ^ 1), 256);
  };
  if (kPingPong && cw == 1) NamedBarrierArrive(1, 256);  // consumer 0 goes first

  // S = Q K^T over head_dim in k-steps of 16: step kk is bytes 32 (kk % 4) of slab kk / 4.
  auto issue_qk = [&](int st) {
    const uint32_t k_tile = s_k + st * Cfg::kTileBytes;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const uint32_t off_q = (kk / 4) * Cfg::kSlabBytesQ + (kk % 4) * 32;
      const uint32_t off_k = (kk / 4) * Cfg::kSlabBytesKv + (kk % 4) * 32;
      WgmmaSS_N128(reinterpret_cast<float(&)[64]>(*s_flat), SmemDescriptor(q_wg + off_q, 16, 1024),
                   SmemDescriptor(k_tile + off_k, 16, 1024), kk > 0 ? 1 : 0);
    }
    WgmmaCommit();
  };
  // O += P V over the tile's keys in k-steps of 16: step kk is rows 16 kk, 2048 bytes on.
  auto issue_pv = [&](int st) {
    const uint32_t v_tile = s_v + st * Cfg::kTileBytes;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t desc = SmemDescriptor(v_tile + kk * 16 * 128, Cfg::kSlabBytesKv, 1024);
      if constexpr (kDim == 128) {
        WgmmaRS_N128(reinterpret_cast<float(&)[64]>(*o_flat), p_frag[kk], desc);
      } else {
        WgmmaRS_N64(reinterpret_cast<float(&)[32]>(*o_flat), p_frag[kk], desc);
      }
    }
    WgmmaCommit();
  };
  // The element mask on a partly visible tile: key validity, padding, causality.
  auto mask_tile = [&](int j) {
    const int key0 = j * kBlockN;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = key0 + nt * 8 + tig * 2 + e;
        const int32_t kp = c < kv_len ? __ldg(kpos_base + c) : -1;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!(kp >= 0 && qp[h] >= 0 && (!p.causal || kp <= qp[h]))) {
            s_acc[nt][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  };
  // Online softmax on S (FlashAttention-2's, as the mma.sync kernel): returns each row's alpha.
  auto softmax = [&](float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_row[h];
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
        mx = fmaxf(mx, fmaxf(s_acc[nt][2 * h], s_acc[nt][2 * h + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      alpha[h] = FastExp2(m_row[h] * p.scale_log2 - m_scaled);
      m_row[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
        float& a = s_acc[nt][2 * h];
        float& b = s_acc[nt][2 * h + 1];
        a = FastExp2(fmaf(a, p.scale_log2, -m_scaled));
        b = FastExp2(fmaf(b, p.scale_log2, -m_scaled));
        sum += a + b;
      }
      l_row[h] = l_row[h] * alpha[h] + sum;
    }
  };
  auto pack_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = PackBf16(s_acc[2 * kk][0], s_acc[2 * kk][1]);
      p_frag[kk][1] = PackBf16(s_acc[2 * kk][2], s_acc[2 * kk][3]);
      p_frag[kk][2] = PackBf16(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]);
      p_frag[kk][3] = PackBf16(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3]);
    }
  };

  int j = next_visible(0);
  if (j < num_k_tiles) {
    // First tile: S, softmax, P.
    MbarWait(full_k(0), 0);
    turn_begin();
    issue_qk(0);
    turn_end();
    WgmmaWait<0>();
    FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(*s_flat));
    __syncwarp();
    if (lane == 0) MbarArrive(empty_k(0));
    if (classify(j) == 1) mask_tile(j);
    float alpha[2];
    softmax(alpha);
    pack_p();
    // Steady state: the next tile's Q K^T and this tile's P V in flight together; the softmax
    // of the next tile runs as soon as its S is back, while P V still runs. The loop has one
    // shape (the last tile's P V is peeled off below), so the compiler can pair every wait with
    // its group and keep the wgmma pipeline unserialized.
    int it = 0;
    int j_next = next_visible(j + 1);
    while (j_next < num_k_tiles) {
      const int st = it % kStages, st_next = (it + 1) % kStages;
      MbarWait(full_k(st_next), ((it + 1) / kStages) & 1);
      turn_begin();
      issue_qk(st_next);
      MbarWait(full_v(st), (it / kStages) & 1);
      issue_pv(st);
      turn_end();
      // The tile after next, and whether the next one needs the mask, while the tensor cores
      // work: the summaries are global loads, too slow to wait for at the loop's end.
      const bool mask_next = classify(j_next) == 1;
      const int j_after = next_visible(j_next + 1);
      WgmmaWait<1>();  // S of the next tile is ready; P V may still run
      FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(*s_flat));
      __syncwarp();
      if (lane == 0) MbarArrive(empty_k(st_next));
      if (mask_next) mask_tile(j_next);
      softmax(alpha);
      WgmmaWait<0>();
      FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(*o_flat));
      __syncwarp();
      if (lane == 0) MbarArrive(empty_v(st));
#pragma unroll
      for (int dt = 0; dt < kDim / 8; ++dt) {
        o_acc[dt][0] *= alpha[0];
        o_acc[dt][1] *= alpha[0];
        o_acc[dt][2] *= alpha[1];
        o_acc[dt][3] *= alpha[1];
      }
      pack_p();
      j = j_next;
      j_next = j_after;
      ++it;
    }
    const int st = it % kStages;
    MbarWait(full_v(st), (it / kStages) & 1);
    turn_begin();
    issue_pv(st);
    turn_end();
    WgmmaWait<0>();
    FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(*o_flat));
    __syncwarp();
    if (lane == 0) MbarArrive(empty_v(st));
  }

  const EpilogueTarget target{p.o, p.lse, p.num_heads, p.group, p.out_mode, p.scale_log2};
  StoreRows16<kDim>(target, kv_head, sl.q_begin, slice_rows, row0 + tile_row, o_acc, m_row,
                    l_row, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace cpfill::attention::cuda::internal
