// cpfill/attention/cuda/flash_common.cuh — what cpfill's attention kernels share: the launch
// layout of both forward kernels (the mma.sync kernel, mma_kernel.cuh; the Hopper kernel,
// hopper_kernel.cuh), the key-tile pre-pass that runs before either, the walk over a slice's
// query tiles and visible key tiles, the epilogue that writes or merges (O, LSE), and small PTX
// wrappers (cp.async, ldmatrix, mma.m16n8k16, ex2, bf16 packing) that the mma.sync kernel, the
// decode kernel (attention_decode.cu) and the Hopper kernel call. No forward kernel lives here.
//
// Main types: SliceDesc (one slice and its place in a launch's tile lists), LaunchCommon (what
// every forward launch carries besides its slice table), KeyTileSummary (the pre-pass's record of
// one key tile), VisibleKeyTiles (which key tiles a query tile visits, and which of them need the
// element mask), EpilogueTarget (where a launch's results go).
//
// A forward launch (attention_cuda.cu; attention_hopper.cu likewise, with HopperParams):
//
//   FlashParams p{};  // LaunchCommon and the kernel's own fields (mma_kernel.cuh)
//   LaunchExtent extent;
//   CPFILL_RETURN_IF_ERROR(PrepareLaunch(a, work, block_m, block_n, summaries, &p, p.slices,
//                                        &extent));
//   KeyTileSummaryKernel<<<SummaryCtas(extent.k_tiles), kSummaryThreads, 0, stream>>>(
//       SummaryParamsOf(p, p.slices), extent.k_tiles, summaries, nullptr);
//   // then the kernel: LocateQueryTile for its query tile, VisibleKeyTiles over the summaries
//   // for the key tiles it visits, StoreRows16 for each m16 tile of its rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/pdl.cuh"

namespace cpfill::attention::cuda::internal {

inline constexpr int kMaxSlicesPerLaunch = 48;

// One slice of the launch, with its place in the launch's tile lists.
struct SliceDesc {
  int64_t q_begin, q_len, kv_begin, kv_len;
  int32_t q_tile_start;  // first CTA (blockIdx.x) of this slice
  int32_t k_tile_start;  // first entry of this slice in the key-tile summaries
  int32_t table_begin;   // paged K/V (the Hopper kernel): the slice's first block-table entry
  // Output row of the slice's first query: q_begin, unless the call's keys are split and this
  // part's (O, LSE) go to a partial buffer of its own (key_split.h).
  int64_t o_begin;
};

// Per key tile: smallest and largest valid key position, whether any key in the tile is
// padding or past the slice, whether any key is valid.
struct KeyTileSummary {
  int32_t min_pos, max_pos, any_invalid, any_valid;
};

enum OutMode : int32_t { kOutBf16 = 0, kOutF32 = 1, kOutMergeF32 = 2 };

// What a launch of either forward kernel carries besides its slice table (and the Hopper
// kernel's tensor maps).
struct LaunchCommon {
  const __nv_bfloat16* q;
  const int32_t* q_pos;
  const int32_t* k_pos;
  void* o;
  float* lse;
  const KeyTileSummary* key_tiles;
  int32_t key_tile;  // keys per summary entry: the kernel's kBlockN
  int32_t num_heads, num_kv_heads, group;
  float scale_log2;  // softmax_scale * log2(e)
  int32_t causal;
  int32_t out_mode;
  int32_t num_slices;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Tile counts of one launch.
struct LaunchExtent {
  int64_t q_tiles = 0;  // CTAs along blockIdx.x
  int64_t k_tiles = 0;  // key-tile summaries
};

// Fills a launch's common fields and its slice table from the slices `work` (indices into
// a.slices): each slice's first CTA (query tiles of block_m folded rows) and first key-tile
// summary (tiles of block_n keys); its output rows from out_rows (indexed as a.slices), or at its
// query rows where that is empty. InvalidArgument when the query tiles exceed one launch.
inline absl::Status PrepareLaunch(const CudaAttentionArgs& a, std::span<const int64_t> work,
                                  int block_m, int block_n, const KeyTileSummary* summaries,
                                  LaunchCommon* c, SliceDesc* slices, LaunchExtent* extent,
                                  std::span<const int64_t> out_rows = {}) {
  const int group = a.shape.group_size();
  c->q = a.q;
  c->q_pos = a.q_pos;
  c->k_pos = a.k_pos;
  c->o = a.o;
  c->lse = a.lse;
  c->key_tiles = summaries;
  c->key_tile = block_n;
  c->num_heads = a.shape.num_heads;
  c->num_kv_heads = a.shape.num_kv_heads;
  c->group = group;
  c->scale_log2 = a.shape.softmax_scale * kLog2e;
  c->causal = a.shape.causal ? 1 : 0;
  c->out_mode = a.output == OutputMode::kBfloat16  ? kOutBf16
                : a.output == OutputMode::kFloat32 ? kOutF32
                                                   : kOutMergeF32;
  c->num_slices = static_cast<int32_t>(work.size());
  *extent = {};
  for (size_t i = 0; i < work.size(); ++i) {
    const SequenceSlice& s = a.slices[work[i]];
    slices[i] =
        SliceDesc{s.q_begin,
                  s.q_len,
                  s.kv_begin,
                  s.kv_len,
                  static_cast<int32_t>(extent->q_tiles),
                  static_cast<int32_t>(extent->k_tiles),
                  static_cast<int32_t>(a.paged == nullptr ? 0 : a.paged->TableBegin(s.kv_begin)),
                  out_rows.empty() ? s.q_begin : out_rows[work[i]]};
    extent->q_tiles += (s.q_len * group + block_m - 1) / block_m;
    extent->k_tiles += (s.kv_len + block_n - 1) / block_n;
  }
  if (extent->q_tiles >= (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA attention: ", extent->q_tiles, " query tiles exceed one launch"));
  }
  return absl::OkStatus();
}

// ---- small PTX wrappers ------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes 0 zero-fills the destination (rows past a slice).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A B: m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;  // ex2(-inf) = +0
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of (row, 8-element chunk) in a swizzled tile of rows of kDim bf16: a row's
// 16-byte chunks are stored at chunk ^ (row & 7), so the 8 rows one ldmatrix phase reads fall in
// 8 different bank groups.
template <int kDim>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  constexpr int kChunks = kDim / 8;
  return static_cast<uint32_t>((row * kChunks + (chunk ^ (row & 7))) * 16);
}

// ---- pre-pass: what each key tile holds ------------------------------------------------

// A warp per key tile, its lanes reading the positions side by side: with a thread per tile,
// each walked its 128 positions one load after another, and the pre-pass took 17-22 µs on an
// H100 even for one or two tiles (ncu, 2026-11-27), longer than the kernel after it on short
// prefills.
inline constexpr int kSummaryThreads = 128;
inline constexpr int kSummaryTilesPerCta = kSummaryThreads / 32;
inline int SummaryCtas(int64_t total_k_tiles) {
  return static_cast<int>(
      total_k_tiles <= 0 ? 1 : (total_k_tiles + kSummaryTilesPerCta - 1) / kSummaryTilesPerCta);
}

// What the pre-pass reads of a launch: 2 KiB, not the Hopper kernel's 14 KiB of tensor maps (a
// launch copies its whole parameter block, about a microsecond per 20 KiB on an H100).
struct SummaryParams {
  const int32_t* k_pos;
  int32_t key_tile, num_slices;
  SliceDesc slices[kMaxSlicesPerLaunch];
};
inline SummaryParams SummaryParamsOf(const LaunchCommon& c, const SliceDesc* slices) {
  SummaryParams s{c.k_pos, c.key_tile, c.num_slices, {}};
  for (int i = 0; i < c.num_slices && i < kMaxSlicesPerLaunch; ++i) s.slices[i] = slices[i];
  return s;
}

// Params: SummaryParams (or any block with slices, num_slices, key_tile and k_pos). Launched as
// SummaryCtas(total_k_tiles) CTAs of kSummaryThreads.
template <typename Params>
__global__ void __launch_bounds__(kSummaryThreads)
    KeyTileSummaryKernel(const __grid_constant__ Params p, int total_k_tiles, KeyTileSummary* out,
                         int32_t* item_counter) {
  // Launched as a dependent on the Hopper path: the kernel before it may still read the counter
  // and the positions; the Hopper kernel after it is placed as soon as this grid has started.
  WaitForPrecedingGrids();
  LetDependentsLaunch();
  const int lane = threadIdx.x % 32;
  const int tile = blockIdx.x * kSummaryTilesPerCta + threadIdx.x / 32;
  // The persistent Hopper kernel's scheduler counter, reset here: this pre-pass runs just
  // before the kernel on the same stream, so the reset costs no launch of its own.
  if (blockIdx.x == 0 && threadIdx.x == 0 && item_counter != nullptr) *item_counter = 0;
  if (tile >= total_k_tiles) return;  // the whole warp: tile is the same on every lane
  // The last slice that starts at or before the tile (tile starts grow with the slice).
  int lo = 0, hi = p.num_slices - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile >= p.slices[mid].k_tile_start) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const SliceDesc& sl = p.slices[lo];
  const int64_t key0 = static_cast<int64_t>(tile - sl.k_tile_start) * p.key_tile;
  int32_t mn = INT32_MAX, mx = -1;
  unsigned valid = 0, invalid = 0;
  for (int i = lane; i < p.key_tile; i += 32) {
    const int32_t pos = key0 + i < sl.kv_len ? p.k_pos[sl.kv_begin + key0 + i] : -1;
    if (pos < 0) {
      invalid = 1;  // padding, or past the slice's keys
    } else {
      valid = 1;
      mn = min(mn, pos);
      mx = max(mx, pos);
    }
  }
  constexpr unsigned kAll = 0xffffffffu;
  mn = __reduce_min_sync(kAll, mn);
  mx = __reduce_max_sync(kAll, mx);
  valid = __reduce_or_sync(kAll, valid);
  invalid = __reduce_or_sync(kAll, invalid);
  if (lane == 0) {
    out[tile] = KeyTileSummary{mn, mx, static_cast<int32_t>(invalid), static_cast<int32_t>(valid)};
  }
}

// The slice and query tile of launch-wide tile index `x` (blockIdx.x for the mma.sync kernel, a
// work item's tile for the persistent Hopper kernel): tiles of a slice are contiguous; within a
// slice the last query tiles (latest positions, most causal work) go first.
struct QueryTile {
  int slice_index;
  SliceDesc slice;
  int m_block;
};
__device__ __forceinline__ QueryTile LocateQueryTile(const SliceDesc* slices, int num_slices,
                                                     int group, int block_m, int x) {
  int s = 0;
  while (s + 1 < num_slices && x >= slices[s + 1].q_tile_start) ++s;
  const SliceDesc sl = slices[s];
  const int num_q_tiles = static_cast<int>((sl.q_len * group + block_m - 1) / block_m);
  return {s, sl, num_q_tiles - 1 - (x - sl.q_tile_start)};
}

// The key tiles of one slice as a CTA's query rows see them, from the pre-pass summaries and the
// CTA's query statistics (smallest and largest valid position, whether a row is padding).
struct VisibleKeyTiles {
  const KeyTileSummary* summaries;
  int num_tiles;
  int32_t q_min, q_max, q_pad, causal;

  // 0: hidden (skip), 1: partly visible (element mask), 2: fully visible (no mask).
  __device__ __forceinline__ int Classify(int j) const {
    const KeyTileSummary ks = summaries[j];
    if (!ks.any_valid || q_max < 0) return 0;
    if (causal && ks.min_pos > q_max) return 0;
    if (!ks.any_invalid && !q_pad && (!causal || ks.max_pos <= q_min)) return 2;
    return 1;
  }
  // The first tile at or after j that is not hidden; num_tiles when there is none.
  __device__ __forceinline__ int NextVisible(int j) const {
    while (j < num_tiles && Classify(j) == 0) ++j;
    return j;
  }
};

// ---- epilogue shared by the mma.sync and the Hopper kernels ------------------------------

// Where a launch's results go.
struct EpilogueTarget {
  void* o;
  float* lse;
  int32_t num_heads, group, out_mode;
  float scale_log2;
};

// Writes (or merges into the running fp32 O/LSE) the two rows this thread holds of one m16 tile:
// slice rows row16 + lane / 4 and row16 + lane / 4 + 8, in the mma accumulator layout
// (o_acc[dt][2 h + {0, 1}] = columns 8 dt + 2 (lane % 4) + {0, 1} of row h). m_row is the
// running max of the raw scores, l_row this thread's part of the row sum (reduced over the quad
// here). The quad's four threads must all call it.
template <int kDim>
__device__ __forceinline__ void StoreRows16(const EpilogueTarget& t, int kv_head, int64_t o_begin,
                                            int64_t slice_rows, int64_t row16,
                                            const float (&o_acc)[kDim / 8][4],
                                            const float (&m_row)[2], const float (&l_row)[2],
                                            int lane) {
  const int group_id = lane >> 2, tig = lane & 3;
  float row_lse[2], inv_l[2];
  int64_t o_row_off[2];
  bool row_in[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int64_t row = row16 + group_id + h * 8;
    row_in[h] = row < slice_rows;
    const int64_t tok = row_in[h] ? row / t.group : 0;
    const int g = row_in[h] ? static_cast<int>(row % t.group) : 0;
    o_row_off[h] = (o_begin + tok) * t.num_heads + kv_head * t.group + g;  // rows of kDim
    const bool empty = l == 0.f;
    row_lse[h] = empty ? -INFINITY : (m_row[h] * t.scale_log2 + __log2f(l)) * kLn2;
    inv_l[h] = empty ? 0.f : 1.f / l;
  }
  if (t.out_mode == kOutMergeF32) {
    // Fold into the running (O, LSE): every old LSE of the quad is read before any is rewritten.
    float* o = static_cast<float*>(t.o);
    float w_old[2], w_new[2], lse_out[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float old = row_in[h] ? t.lse[o_row_off[h]] : -INFINITY;
      const float mx = fmaxf(old, row_lse[h]);
      if (mx == -INFINITY) {
        w_old[h] = 1.f;  // both empty: keep the old values as they are
        w_new[h] = 0.f;
        lse_out[h] = -INFINITY;
      } else {
        const float eo = __expf(old - mx), en = __expf(row_lse[h] - mx);
        w_old[h] = eo / (eo + en);
        w_new[h] = en / (eo + en);
        lse_out[h] = mx + __logf(eo + en);
      }
    }
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!row_in[h]) continue;
      float* orow = o + o_row_off[h] * kDim;
#pragma unroll
      for (int dt = 0; dt < kDim / 8; ++dt) {
        const int col = dt * 8 + tig * 2;
        float2 old = *reinterpret_cast<float2*>(orow + col);
        old.x = old.x * w_old[h] + o_acc[dt][2 * h] * inv_l[h] * w_new[h];
        old.y = old.y * w_old[h] + o_acc[dt][2 * h + 1] * inv_l[h] * w_new[h];
        *reinterpret_cast<float2*>(orow + col) = old;
      }
      if (tig == 0) t.lse[o_row_off[h]] = lse_out[h];
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!row_in[h]) continue;
#pragma unroll
    for (int dt = 0; dt < kDim / 8; ++dt) {
      const int col = dt * 8 + tig * 2;
      const float x = o_acc[dt][2 * h] * inv_l[h], y = o_acc[dt][2 * h + 1] * inv_l[h];
      if (t.out_mode == kOutF32) {
        *reinterpret_cast<float2*>(static_cast<float*>(t.o) + o_row_off[h] * kDim + col) =
            make_float2(x, y);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(t.o) + o_row_off[h] * kDim +
                                           col) = __floats2bfloat162_rn(x, y);
      }
    }
    if (tig == 0) t.lse[o_row_off[h]] = row_lse[h];
  }
}

}  // namespace cpfill::attention::cuda::internal
