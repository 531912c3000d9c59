// cpfill/attention/cuda/hopper_kernel.cuh — the Hopper (sm_90a) partial-attention kernel:
// TMA loads into an mbarrier pipeline, wgmma for both products, warp-specialized warpgroups.
//
// Same contract as flash_kernel.cuh (fused varseq slices, per-token global positions, GQA folded
// into the M tile, three output modes, the key-tile summaries of the pre-pass); this file only
// changes how the work is done:
//
//   a work item = one (slice, kv head, query tile of 128 folded rows); a persistent CTA (one per
//   SM) takes the next free item from a global counter when it needs one (the items are in
//   longest-first order, so the SMs finish together), with 3 warpgroups:
//     warpgroup 0, the producer: gives its registers away (setmaxnreg); warps 1-3 take the next
//       item and publish it with its query positions and their range (the "item" slot, double
//       buffered), then load its Q tile (cp.async) into one of kQBuffers Q buffers, so with
//       two the next item's Q lands while the consumers work on this one; one thread of warp 0
//       issues the TMA loads of the visible K and V tiles (128 keys each) into a kStages-deep
//       ring of shared-memory buffers, each guarded by a "full" and an "empty" mbarrier, and
//       tells the consumers each tile's class (masked or not, last of its item) in a word
//       beside the stage. It needs only the item slot, not Q, so it runs on into the next item
//       while the consumers still finish this one;
//     warpgroups 1 and 2, the consumers: 64 query rows each. S = Q K^T by wgmma with both
//       operands in shared memory; the online softmax in registers; O += P V by wgmma with P
//       straight from the S accumulators (bf16 A fragments, never through shared memory).
//
// Within a consumer the next tile's Q K^T is issued before this tile's P V, so the softmax of
// tile j+1 runs while the tensor cores still do P V of tile j (FlashAttention-3's intra-warpgroup
// overlap); K is released as soon as Q K^T has read it, V after P V. The consumers' loop does no
// global load and builds no descriptor: both showed up as its stalls under Nsight Compute
// (bench/RESULTS.md), so tile classes come from the K/V thread and descriptors are moved by an
// add.
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
  int32_t num_q_tiles;    // work items: num_q_tiles x num_kv_heads
  int32_t* item_counter;  // the scheduler's next free item past the first wave, or null for
                          // the static schedule (CTA b takes b, b + grid, ...)
};
static_assert(sizeof(HopperParams) <= 32764, "kernel parameters must fit 32764 bytes");

inline constexpr int kHopperBlockM = 128;  // 2 consumer warpgroups x 64 rows
inline constexpr int kHopperBlockN = 128;  // keys per K/V tile
inline constexpr int kHopperThreads = 384;
// Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 = 64512 of the SM's 65536. The
// producer needs 56 (not the 24 of a TMA-only producer): its warps 1-3 walk the work items and
// compute the gather addresses of the next item's Q rows, and at 40 or 48 ptxas spilled them to
// local memory; the consumers still fit 224 with no spill.
inline constexpr int kProducerRegisters = 56;
// A K/V stage's tile info: the key tile's index in its slice, and two flags.
inline constexpr int kTileMasked = 1 << 30;  // partly visible: the element mask applies
inline constexpr int kTileLast = 1 << 29;    // the item's last visible tile
inline constexpr int kTileNone = 1 << 28;    // the item has no visible tile: the stage is empty
inline constexpr int kTileIndex = kTileNone - 1;
inline constexpr int kConsumerRegisters = 224;

template <int kDim, int kStages, int kQBuffers>
struct HopperConfig {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kSlabs = kDim / 64;                      // 128-byte-wide column slabs
  static constexpr int kSlabBytesQ = 64 * 128;                  // 64 rows of one consumer
  static constexpr int kSlabBytesKv = kHopperBlockN * 128;      // 128 keys
  static constexpr int kQBytesPerWarpgroup = kSlabs * kSlabBytesQ;
  static constexpr int kQBytes = 2 * kQBytesPerWarpgroup;
  static constexpr int kTileBytes = kSlabs * kSlabBytesKv;      // one K or V tile
  // + 1024: the dynamic buffer is re-aligned to the 1024-byte swizzle period at run time.
  static constexpr int kSmemBytes = kQBuffers * kQBytes + 2 * kStages * kTileBytes + 1024;
  // 227 KiB per block on sm_90, less about 1.2 KiB of static barriers and positions.
  static_assert(kSmemBytes <= 227 * 1024 - 2048, "K/V stages exceed shared memory");
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

// 16 bytes global -> shared without registers; `valid` false writes 16 zero bytes instead.
__device__ __forceinline__ void CpAsync16ZeroFill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
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

// A descriptor `bytes` further on in shared memory: the address field (bits 0-13, in 16-byte
// units) of a descriptor for an address below 256 KiB never carries into the next field, so
// descriptors are built once and moved with one add instead of rebuilt for every wgmma.
__device__ __forceinline__ uint64_t DescriptorPlus(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
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

// kPingPong: the two consumer warpgroups take turns issuing their products (FlashAttention-3's
// ping-pong), so one warpgroup's softmax runs while the other's products keep the tensor cores
// busy.
//
// Persistent: CTA b takes item b first, then the next free one from p.item_counter (or b +
// gridDim.x, ... with the static schedule); the launcher sizes the grid to the SMs, and with
// gridDim.x = num_items every CTA takes one item, the non-persistent schedule. An item index
// past the end tells every warp of the CTA to stop.
//
// Item n's slot (n & 1) holds its index, query positions and position range. Warps 1-3 fill it
// as soon as item n - 2's readers have released it (the K/V thread and the 8 consumer warps
// each arrive on item_free once they have read it); so the K/V thread learns item n + 1's
// visible tiles while the consumers still work on item n, and a short item pays no cold
// pipeline fill. Q is single-buffered: its loads for item n + 1 start once the consumers' last
// Q K^T of item n has read Q, i.e. during the last P V and the epilogue.
template <int kDim, int kStages, int kQBuffers, bool kPingPong>
__global__ void __launch_bounds__(kHopperThreads, 1)
    HopperFlashKernel(const __grid_constant__ HopperParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = HopperConfig<kDim, kStages, kQBuffers>;
  constexpr int kBlockM = kHopperBlockM, kBlockN = kHopperBlockN;
  constexpr int kLoaderThreads = 96;  // producer warps 1-3
  constexpr int kLoaderBarrier = 3;   // named barriers 1 and 2 are the consumers' turns
  extern __shared__ unsigned char smem_raw[];
  // full K, full V, empty K, empty V per stage; then Q full, Q empty, item ready x 2 and item
  // free x 2.
  __shared__ __align__(8) uint64_t bars[4 * kStages + 2 * kQBuffers + 4];
  __shared__ int32_t s_item[2];             // [slot]: the item's index; >= num_items: stop
  // [stage]: which key tile the stage holds, with kTileMasked and kTileLast; written by the K/V
  // thread before it arrives on the stage's "full K" barrier, so the consumers learn the tile's
  // class from shared memory instead of a chain of global loads of the summaries.
  __shared__ int32_t s_tile_info[kStages];
  __shared__ int32_t s_qpos[2][kBlockM];    // [slot][row]
  __shared__ int32_t s_qstat[2][3][3];      // [slot][loader warp][min, max, padding]
  const uint32_t smem_base = (SmemAddr(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_q = smem_base;
  const uint32_t s_k = s_q + kQBuffers * Cfg::kQBytes;
  const uint32_t s_v = s_k + kStages * Cfg::kTileBytes;
  auto full_k = [&](int st) { return SmemAddr(&bars[st]); };
  auto full_v = [&](int st) { return SmemAddr(&bars[kStages + st]); };
  auto empty_k = [&](int st) { return SmemAddr(&bars[2 * kStages + st]); };
  auto empty_v = [&](int st) { return SmemAddr(&bars[3 * kStages + st]); };
  // Item n's Q is in buffer n % kQBuffers; its barriers' phase is n / kQBuffers.
  auto q_full = [&](int b) { return SmemAddr(&bars[4 * kStages + b]); };
  auto q_empty = [&](int b) { return SmemAddr(&bars[4 * kStages + kQBuffers + b]); };
  auto item_ready = [&](int slot) { return SmemAddr(&bars[4 * kStages + 2 * kQBuffers + slot]); };
  auto item_free = [&](int slot) { return SmemAddr(&bars[4 * kStages + 2 * kQBuffers + 2 + slot]); };

  // Thread indices are read again after each setmaxnreg: a value live across it is spilled.
  const int warpgroup = threadIdx.x / 128;
  const int G = p.group;
  const int num_items = p.num_q_tiles * p.num_kv_heads;

  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      MbarInit(full_k(st), 1);
      MbarInit(full_v(st), 1);
      MbarInit(empty_k(st), 8);  // one arrival per consumer warp
      MbarInit(empty_v(st), 8);
    }
    for (int b = 0; b < kQBuffers; ++b) {
      MbarInit(q_full(b), kLoaderThreads);  // every loader thread, after its own copies landed
      MbarInit(q_empty(b), 8);              // every consumer warp, after its last Q K^T of an item
    }
    for (int slot = 0; slot < 2; ++slot) {
      MbarInit(item_ready(slot), kLoaderThreads);  // every loader thread, after its writes
      MbarInit(item_free(slot), 9);  // the 8 consumer warps and the K/V thread, having read it
    }
  }
  __syncthreads();

  // Item n's index once its slot is filled (num_items or more: stop).
  auto wait_item = [&](int n) {
    MbarWait(item_ready(n & 1), (n >> 1) & 1);
    return s_item[n & 1];
  };
  // The visible key tiles of an item, from the statistics its loaders left in slot n & 1.
  auto visible_tiles = [&](const SliceDesc& sl, int slot) {
    int32_t q_min = INT32_MAX, q_max = -1, q_pad = 0;
#pragma unroll
    for (int w = 0; w < 3; ++w) {
      q_min = min(q_min, s_qstat[slot][w][0]);
      q_max = max(q_max, s_qstat[slot][w][1]);
      q_pad |= s_qstat[slot][w][2];
    }
    return VisibleKeyTiles{p.key_tiles + sl.k_tile_start,
                           static_cast<int>((sl.kv_len + kBlockN - 1) / kBlockN),
                           q_min,
                           q_max,
                           q_pad,
                           p.causal};
  };

  if (warpgroup == 0) {
    SetMaxRegistersDec<kProducerRegisters>();
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (warp == 0) {
      // ---- producer, K/V: one thread issues the TMA loads of every item's visible tiles ----
      if (lane != 0) return;
      int g = 0;  // tiles issued so far by this CTA: the ring's stage and phase
      for (int n = 0;; ++n) {
        const int slot = n & 1;
        const int item_index = wait_item(n);
        if (item_index >= num_items) return;
        const HopperItem item = LocateHopperItem(p, item_index);
        const VisibleKeyTiles tiles = visible_tiles(item.tile.slice, slot);
        MbarArrive(item_free(slot));
        const CUtensorMap* kmap = &p.k_maps[item.tile.slice_index];
        const CUtensorMap* vmap = &p.v_maps[item.tile.slice_index];
        // Every visible tile fills one stage. An item with none still fills one, with no data
        // (an arrival of 0 bytes completes each barrier's phase) and kTileNone, so the consumers
        // learn it from the ring and never read the summaries.
        int j = tiles.NextVisible(0);
        const bool none = j >= tiles.num_tiles;
        const uint32_t bytes = none ? 0u : static_cast<uint32_t>(Cfg::kTileBytes);
        do {
          const int j_next = none ? j : tiles.NextVisible(j + 1);
          const int info = none ? kTileNone
                                : j | (tiles.Classify(j) == 1 ? kTileMasked : 0) |
                                      (j_next >= tiles.num_tiles ? kTileLast : 0);
          const int st = g % kStages;
          const uint32_t free_parity = ((g / kStages) & 1) ^ 1;
          MbarWait(empty_k(st), free_parity);
          s_tile_info[st] = info;  // released by the arrive below
          // Key tile j of the item into the stage's K or V buffer, one TMA per 64-column slab.
          auto load = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar) {
#pragma unroll
            for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
              TmaLoad2d(dst + slab * Cfg::kSlabBytesKv, map, item.kv_head * kDim + slab * 64,
                        j * kBlockN, bar);
            }
          };
          MbarArriveExpectTx(full_k(st), bytes);
          if (!none) load(s_k + st * Cfg::kTileBytes, kmap, full_k(st));
          MbarWait(empty_v(st), free_parity);
          MbarArriveExpectTx(full_v(st), bytes);
          if (!none) load(s_v + st * Cfg::kTileBytes, vmap, full_v(st));
          j = j_next;
          ++g;
        } while (!none && j < tiles.num_tiles);
      }
      return;
    }
    // ---- producer, Q: warps 1-3 load each item's Q tile, positions and statistics ----
    const int t = tid - 32;
    for (int n = 0;; ++n) {
      const int slot = n & 1;
      if (n >= 2) MbarWait(item_free(slot), ((n - 2) >> 1) & 1);  // item n - 2 was read
      if (t == 0) {
        int next = static_cast<int>(blockIdx.x);
        if (n > 0) {
          next = p.item_counter != nullptr
                     ? static_cast<int>(gridDim.x) + atomicAdd(p.item_counter, 1)
                     : static_cast<int>(blockIdx.x) + n * static_cast<int>(gridDim.x);
        }
        s_item[slot] = min(next, num_items);
      }
      NamedBarrierSync(kLoaderBarrier, kLoaderThreads);
      const int item_index = s_item[slot];
      if (item_index >= num_items) {
        MbarArrive(item_ready(slot));  // the stop, to the K/V thread and the consumers
        return;
      }
      const HopperItem item = LocateHopperItem(p, item_index);
      const SliceDesc& sl = item.tile.slice;
      const int64_t slice_rows = sl.q_len * G;
      const int64_t row0 = static_cast<int64_t>(item.tile.m_block) * kBlockM;
      int32_t mn = INT32_MAX, mx = -1, pad = 0;
      for (int r = t; r < kBlockM; r += kLoaderThreads) {
        const int64_t row = row0 + r;
        const bool in = row < slice_rows;
        const int32_t pos = in ? p.q_pos[sl.q_begin + row / G] : -1;
        s_qpos[slot][r] = pos;
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
        s_qstat[slot][warp - 1][0] = mn;
        s_qstat[slot][warp - 1][1] = mx;
        s_qstat[slot][warp - 1][2] = pad;
      }
      MbarArrive(item_ready(slot));
      // The consumers are done reading this buffer's last Q (item n - kQBuffers).
      const int qb = n % kQBuffers;
      if (n >= kQBuffers) MbarWait(q_empty(qb), ((n - kQBuffers) / kQBuffers) & 1);
      // Q rows into the swizzled layout; rows past the slice are zero-filled by the copy. A
      // thread keeps one 16-byte column chunk and walks rows 6 apart (96 threads, 16 chunks).
      static_assert(kLoaderThreads % (kDim / 8) == 0);
      constexpr int kRowStep = kLoaderThreads / (kDim / 8);
      const int c = t % (kDim / 8), slab = c / 8, cc = c % 8;
      const __nv_bfloat16* q_head =
          p.q + static_cast<int64_t>(item.kv_head) * G * kDim + c * 8;  // + token, + group
      const int64_t q_stride = static_cast<int64_t>(p.num_heads) * kDim;
      // Not unrolled: the loads run an item ahead, off the critical path, and unrolled the
      // row addresses outgrow the producer's 56 registers.
#pragma unroll 1
      for (int r = t / (kDim / 8); r < kBlockM; r += kRowStep) {
        const int64_t row = row0 + r;
        const bool in = row < slice_rows;
        const int64_t token = sl.q_begin + row / G;
        const __nv_bfloat16* src =
            in ? q_head + token * q_stride + static_cast<int64_t>(row - (row / G) * G) * kDim : p.q;
        const int wg = r / 64, rr = r % 64;
        CpAsync16ZeroFill(s_q + qb * Cfg::kQBytes + wg * Cfg::kQBytesPerWarpgroup +
                              slab * Cfg::kSlabBytesQ +
                              rr * 128 + ((cc ^ (rr & 7)) << 4),
                          src, in);
      }
      CpAsyncWaitAll();
      FenceProxyAsync();  // Q is read by wgmma (the async proxy)
      MbarArrive(q_full(qb));
    }
    return;
  }

  // ---- consumers ----
  SetMaxRegistersInc<kConsumerRegisters>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cw = warpgroup - 1;        // consumer warpgroup: rows 64 cw .. 64 cw + 63
  const int wq = warp % 4;             // warp in the warpgroup: rows 16 wq .. 16 wq + 15
  const int group_id = lane >> 2, tig = lane & 3;
  const int tile_row = cw * 64 + wq * 16;
  const uint32_t q_wg = s_q + cw * Cfg::kQBytesPerWarpgroup;

  float o_acc[kDim / 8][4];
  float* o_flat = &o_acc[0][0];
  float s_acc[kBlockN / 8][4];
  float* s_flat = &s_acc[0][0];
  uint32_t p_frag[kBlockN / 16][4];
  float m_row[2], l_row[2];
  // Turns at the tensor cores: consumer c waits on barrier 1 + c, then hands the turn over. Both
  // consumers take the same number of turns per item, so the order holds across items.
  auto turn_begin = [&] {
    if constexpr (kPingPong) NamedBarrierSync(1 + cw, 256);
  };
  auto turn_end = [&] {
    if constexpr (kPingPong) NamedBarrierArrive(1 + (cw ^ 1), 256);
  };
  if (kPingPong && cw == 1) NamedBarrierArrive(1, 256);  // consumer 0 goes first
  int qb = 0;  // the current item's Q buffer
  // This warp is done reading Q for the item: once all 8 are, the loaders may replace it.
  auto release_q = [&] {
    __syncwarp();
    if (lane == 0) MbarArrive(q_empty(qb));
  };

  const uint64_t q_desc = SmemDescriptor(q_wg, 16, 1024);
  uint64_t q_desc_item = q_desc;
  const uint64_t k_desc = SmemDescriptor(s_k, 16, 1024);
  const uint64_t v_desc = SmemDescriptor(s_v, Cfg::kSlabBytesKv, 1024);
  // S = Q K^T over head_dim in k-steps of 16: step kk is bytes 32 (kk % 4) of slab kk / 4.
  auto issue_qk = [&](int st) {
    const uint64_t k_tile = DescriptorPlus(k_desc, st * Cfg::kTileBytes);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const uint32_t off_q = (kk / 4) * Cfg::kSlabBytesQ + (kk % 4) * 32;
      const uint32_t off_k = (kk / 4) * Cfg::kSlabBytesKv + (kk % 4) * 32;
      WgmmaSS_N128(reinterpret_cast<float(&)[64]>(*s_flat), DescriptorPlus(q_desc_item, off_q),
                   DescriptorPlus(k_tile, off_k), kk > 0 ? 1 : 0);
    }
    WgmmaCommit();
  };
  // O += P V over the tile's keys in k-steps of 16: step kk is rows 16 kk, 2048 bytes on.
  auto issue_pv = [&](int st) {
    const uint64_t v_tile = DescriptorPlus(v_desc, st * Cfg::kTileBytes);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t desc = DescriptorPlus(v_tile, kk * 16 * 128);
      if constexpr (kDim == 128) {
        WgmmaRS_N128(reinterpret_cast<float(&)[64]>(*o_flat), p_frag[kk], desc);
      } else {
        WgmmaRS_N64(reinterpret_cast<float(&)[32]>(*o_flat), p_frag[kk], desc);
      }
    }
    WgmmaCommit();
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < kDim / 8; ++dt) {
      o_acc[dt][0] *= alpha[0];
      o_acc[dt][1] *= alpha[0];
      o_acc[dt][2] *= alpha[1];
      o_acc[dt][3] *= alpha[1];
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

  int g = 0;  // tiles consumed so far by this CTA: the ring's stage and phase
  auto stage = [&](int i) { return (g + i) % kStages; };
  auto phase = [&](int i) { return static_cast<uint32_t>(((g + i) / kStages) & 1); };
  for (int n = 0;; ++n) {
    const int slot = n & 1;
    const int item_index = wait_item(n);
    if (item_index >= num_items) break;
    const HopperItem item = LocateHopperItem(p, item_index);
    const SliceDesc sl = item.tile.slice;
    const int64_t slice_rows = sl.q_len * G;
    const int64_t row0 = static_cast<int64_t>(item.tile.m_block) * kBlockM;
    const int32_t qp[2] = {s_qpos[slot][tile_row + group_id], s_qpos[slot][tile_row + group_id + 8]};
    __syncwarp();
    if (lane == 0) MbarArrive(item_free(slot));
    qb = n % kQBuffers;
    q_desc_item = DescriptorPlus(q_desc, qb * Cfg::kQBytes);
    MbarWait(q_full(qb), (n / kQBuffers) & 1);
    const int32_t* kpos_base = p.k_pos + sl.kv_begin;
    const int kv_len = static_cast<int>(sl.kv_len);

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
    // Online softmax on S (FlashAttention-2's, as the mma.sync kernel): each row's alpha. Both
    // rows at once, and each row's max and sum as four independent partial chains: one chain of
    // 32 dependent operations per row left the warp waiting on every result (the softmax runs
    // while the other warpgroup has the tensor cores, so its latency is what must be hidden).
    auto softmax = [&](float (&alpha)[2]) {
      constexpr int kChains = 4;
      float part[2][kChains];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int c = 0; c < kChains; ++c) part[h][c] = fmaxf(s_acc[c][2 * h], s_acc[c][2 * h + 1]);
      }
#pragma unroll
      for (int nt = kChains; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          part[h][nt % kChains] =
              fmaxf(part[h][nt % kChains], fmaxf(s_acc[nt][2 * h], s_acc[nt][2 * h + 1]));
        }
      }
      float mx[2], m_scaled[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(fmaxf(part[h][0], part[h][1]), fmaxf(part[h][2], fmaxf(part[h][3], m_row[h])));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
#pragma unroll
      for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_scaled[h] = mx[h] == -INFINITY ? 0.f : mx[h] * p.scale_log2;
        alpha[h] = FastExp2(m_row[h] * p.scale_log2 - m_scaled[h]);
        m_row[h] = mx[h];
#pragma unroll
        for (int c = 0; c < kChains; ++c) part[h][c] = 0.f;
      }
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& a = s_acc[nt][2 * h];
          float& b = s_acc[nt][2 * h + 1];
          a = FastExp2(fmaf(a, p.scale_log2, -m_scaled[h]));
          b = FastExp2(fmaf(b, p.scale_log2, -m_scaled[h]));
          part[h][nt % kChains] += a + b;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l_row[h] = l_row[h] * alpha[h] + ((part[h][0] + part[h][1]) + (part[h][2] + part[h][3]));
      }
    };

#pragma unroll
    for (int i = 0; i < kDim / 2; ++i) o_flat[i] = 0.f;
    m_row[0] = m_row[1] = -INFINITY;
    l_row[0] = l_row[1] = 0.f;
    // A stage's info is read before its K is released: the K/V thread rewrites it for the
    // stage's next tile.
    MbarWait(full_k(stage(0)), phase(0));
    int info = s_tile_info[stage(0)];
    if (info & kTileNone) {
      // No visible key: the stage holds no data; both of its barriers are released (V after
      // its phase completed, so no arrival can run ahead into the next phase).
      MbarWait(full_v(stage(0)), phase(0));
      __syncwarp();
      if (lane == 0) {
        MbarArrive(empty_k(stage(0)));
        MbarArrive(empty_v(stage(0)));
      }
      release_q();
      g += 1;
    } else {
      // First tile: S, softmax, P.
      turn_begin();
      issue_qk(stage(0));
      turn_end();
      WgmmaWait<0>();
      FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(*s_flat));
      __syncwarp();
      if (lane == 0) MbarArrive(empty_k(stage(0)));
      if (info & kTileLast) release_q();
      if (info & kTileMasked) mask_tile(info & kTileIndex);
      float alpha[2];
      softmax(alpha);
      pack_p();
      // Steady state: the next tile's Q K^T and this tile's P V in flight together; the softmax
      // of the next tile runs as soon as its S is back, while P V still runs. The loop has one
      // shape (the last tile's P V is peeled off below), so the compiler can pair every wait
      // with its group and keep the wgmma pipeline unserialized.
      int it = 0;
      while (!(info & kTileLast)) {
        const int st = stage(it), st_next = stage(it + 1);
        MbarWait(full_k(st_next), phase(it + 1));
        const int info_next = s_tile_info[st_next];
        turn_begin();
        issue_qk(st_next);
        MbarWait(full_v(st), phase(it));
        issue_pv(st);
        turn_end();
        WgmmaWait<1>();  // S of the next tile is ready; P V may still run
        FenceRegisters(reinterpret_cast<float(&)[kBlockN / 2]>(*s_flat));
        __syncwarp();
        if (lane == 0) MbarArrive(empty_k(st_next));
        if (info_next & kTileLast) release_q();  // that was the item's last Q K^T
        if (info_next & kTileMasked) mask_tile(info_next & kTileIndex);
        softmax(alpha);
        WgmmaWait<0>();
        FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(*o_flat));
        __syncwarp();
        if (lane == 0) MbarArrive(empty_v(st));
        rescale_o(alpha);  // the next tile's alpha
        pack_p();
        info = info_next;
        ++it;
      }
      const int st = stage(it);
      MbarWait(full_v(st), phase(it));
      turn_begin();
      issue_pv(st);
      turn_end();
      WgmmaWait<0>();
      FenceRegisters(reinterpret_cast<float(&)[kDim / 2]>(*o_flat));
      __syncwarp();
      if (lane == 0) MbarArrive(empty_v(st));
      g += it + 1;
    }

    const EpilogueTarget target{p.o, p.lse, p.num_heads, p.group, p.out_mode, p.scale_log2};
    StoreRows16<kDim>(target, item.kv_head, sl.q_begin, slice_rows, row0 + tile_row, o_acc, m_row,
                      l_row, lane);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace cpfill::attention::cuda::internal
