// The split-KV decode kernel, its combine kernel and their launcher (attention_decode.h).
//
// Work of one call: every slice with query rows, its q_len * group packed rows in m16 tiles,
// its keys in splits of whole 64-key tiles. One CTA = (slice, m16 tile, split) x KV head
// (blockIdx.y); its four warps each take 16 keys of every tile and keep their own online
// softmax state, merged in shared memory at the end. A launch of up to 512 slices; where every
// slice is one split (a batch that fills the GPU with a CTA per slice), the split kernel writes
// the call's output and no combine runs.
//
// Workspace (DecodeWorkspaceBytes), partial rows numbered per slice from its partial_row:
//   o_part   [partial rows][num_heads][head_dim] fp32  partial row of (split j, token t) is
//                                                     partial_row + j * q_len + t
//   lse_part [partial rows][num_heads] fp32 (natural log; -inf: the split saw no key)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/cuda/attention_decode.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/pdl.cuh"
#include "attention/online_softmax.h"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::attention::cuda::internal {
namespace {

constexpr int kDecodeBlockN = 64;  // keys per shared-memory tile; each warp takes 16
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeStages = 3;      // cp.async ring of K/V tiles: two in flight per CTA
constexpr int kMinTilesPerSplit = 2;  // below this a split is mostly its prologue and epilogue
// Slices per launch, in the large kernel-parameter space of CUDA 12.1+ (32764 bytes). A batch
// of up to this many sequences is one launch that fills the GPU; with 64 (the 4 KiB limit of
// older toolkits) a decode batch of 256 ran as four launches one after another, each a quarter
// of a wave.
#if CUDART_VERSION >= 12010
constexpr int kMaxDecodeSlices = 512;
#else
constexpr int kMaxDecodeSlices = 64;
#endif
constexpr int kCombineThreads = 256;
constexpr int kMaxSplits = 1024;  // per slice: the combine keeps every split's LSE in shared memory

// One slice of a launch.
struct DecodeSlice {
  int64_t q_begin, kv_begin;
  int32_t q_len, kv_len;
  int32_t item_start;       // first CTA (blockIdx.x) of the slice: m16 tiles x splits CTAs
  int32_t splits;           // key splits; 0 when the slice has no keys
  int32_t tiles_per_split;  // 64-key tiles per split (the last one may hold fewer)
  int32_t partial_row;      // the slice's first partial row in the workspace
  int32_t pair_start;       // first (token, head) pair of the slice in the combine grid
  int32_t table_begin;      // paged K/V: the slice's first block-table entry
};

// The launch parameters but the slices.
struct DecodeCommon {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int32_t* q_pos;
  const int32_t* k_pos;
  float* o_part;    // workspace, see the file comment
  float* lse_part;  // workspace, after o_part
  void* o;          // the call's output (bf16 or fp32 by out_mode)
  float* lse;
  // Paged K/V (attention.h's PagedKv): k/v are the pools' block 0, key r of a slice lies in
  // block block_table[table_begin + r / block_tokens]; null: contiguous rows from kv_begin.
  const int32_t* block_table;
  int64_t block_stride;  // elements from one block to the next
  int32_t block_tokens;
  int32_t num_heads, num_kv_heads, group, causal, out_mode, num_slices;
  // Every slice of the launch in one split: the split kernel writes the call's output itself
  // and no combine runs (a large batch fills the GPU with a CTA per slice and KV head).
  int32_t direct;
  float scale_log2;  // softmax_scale * log2(e)
};

// With room for kSlices slices, in two sizes: a launch copies its whole parameter block, and
// the 512-slice one (25 KiB) cost a short decode step about 2 µs a launch more than the
// 64-slice one (3 KiB) on an H100.
template <int kSlices>
struct DecodeParams : DecodeCommon {
  DecodeSlice slices[kSlices];
};
inline constexpr int kFewDecodeSlices = 64;
static_assert(sizeof(DecodeParams<kMaxDecodeSlices>) <= 32764,
              "kernel parameters must fit 32764 bytes");

template <int kDim>
struct DecodeConfig {
  static constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = 16 * kDim * 2;
  static constexpr int kTileBytes = kDecodeBlockN * kDim * 2;
  static constexpr int kStageBytes = 2 * kTileBytes + kDecodeBlockN * 4;  // K | V | positions
  static constexpr int kSmemBytes = kQBytes + kDecodeStages * kStageBytes;
  // The epilogue exchanges the warps' O through the stages, rows padded by 4 floats so the 8
  // rows of a store phase fall in different banks.
  static constexpr int kExchangeStride = kDim + 4;
  static_assert(kDecodeWarps * 16 * kExchangeStride * 4 <= kDecodeStages * kStageBytes,
                "the O exchange fits the stages");
};

__host__ __device__ inline int32_t MTiles(int64_t q_len, int group) {
  return static_cast<int32_t>((q_len * group + 15) / 16);
}
__host__ __device__ inline int32_t KeyTiles(int64_t kv_len) {
  return static_cast<int32_t>((kv_len + kDecodeBlockN - 1) / kDecodeBlockN);
}

// The slice of launch-wide index x, by one of the slices' start fields (CTAs or pairs, which
// grow with the slice): the last slice that starts at or before x, found by bisection.
template <int32_t DecodeSlice::*kStart, typename Params>
__device__ __forceinline__ int FindSlice(const Params& p, int x) {
  int lo = 0, hi = p.num_slices - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (x >= p.slices[mid].*kStart) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ int64_t PartialRow(const DecodeSlice& sl, int split, int token, int head,
                                              int num_heads) {
  return (static_cast<int64_t>(sl.partial_row) + static_cast<int64_t>(split) * sl.q_len + token) *
             num_heads +
         head;
}

// ---- the call's output ------------------------------------------------------------------

// The call's result (o, lse) for one (token, head) row, as the output mode wants it: lane c of
// the row's kDim / 4 threads holds columns 4c..4c+3. `lanes` masks those threads in their warp.
template <int kDim>
__device__ __forceinline__ void WriteRow(const DecodeCommon& p, int64_t out_row, int c,
                                         unsigned lanes, float4 o, float lse) {
  if (p.out_mode == kOutMergeF32) {
    // Fold into the running (O, LSE): every lane reads the old LSE before lane 0 rewrites it.
    const float old_lse = p.lse[out_row];
    __syncwarp(lanes);
    LseMerge<float> merge;
    merge.Add(old_lse, 0);
    merge.Add(lse, 1);
    if (merge.empty()) return;  // both empty: the running values stay as they are
    const float w_old = merge.Weight(old_lse, 0), w_new = merge.Weight(lse, 1);
    const float rest = merge.arg_max() == 0 ? w_new : w_old;
    const float norm = LseMerge<float>::Normalizer(rest);
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.o) + out_row * kDim) + c;
    // An empty running row (w_old = 0) is not read: O = 0 is its contract, not its memory.
    const float4 x = w_old == 0.f ? make_float4(0.f, 0.f, 0.f, 0.f) : *dst;
    const float a = w_old * norm, b = w_new * norm;
    *dst = make_float4(a * x.x + b * o.x, a * x.y + b * o.y, a * x.z + b * o.z, a * x.w + b * o.w);
    if (c == 0) p.lse[out_row] = merge.Lse(rest);
    return;
  }
  if (p.out_mode == kOutF32) {
    reinterpret_cast<float4*>(static_cast<float*>(p.o) + out_row * kDim)[c] = o;
  } else {
    __nv_bfloat162* dst =
        reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.o) + out_row * kDim) +
        2 * c;
    dst[0] = __floats2bfloat162_rn(o.x, o.y);
    dst[1] = __floats2bfloat162_rn(o.z, o.w);
  }
  if (c == 0) p.lse[out_row] = lse;
}

// ---- the split kernel --------------------------------------------------------------------

// Writes the CTA's partial (O, LSE) per packed row: the four warps' states, each relative to
// its own running max, merged through shared memory (s_o: [warps][16][kExchangeStride]); with
// p.direct, the call's output rows instead (the combine of one split is the identity).
template <int kDim>
__device__ __forceinline__ void StoreSplit(const DecodeCommon& p, const DecodeSlice& sl, int split,
                                           int row0, const float* s_o, const float (*s_m)[16],
                                           const float (*s_l)[16]) {
  using Cfg = DecodeConfig<kDim>;
  constexpr int kQuads = kDim / 4;
  const int rows = sl.q_len * p.group;
  for (int i = threadIdx.x; i < 16 * kQuads; i += kDecodeThreads) {
    const int r = i / kQuads, c = i % kQuads;
    if (row0 + r >= rows) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, s_m[w][r]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      // A warp that saw no key has m = -inf: weight exp2(-inf) = 0, and its O is 0.
      const float wt = m == -INFINITY ? 0.f : FastExp2((s_m[w][r] - m) * p.scale_log2);
      const float4 x =
          reinterpret_cast<const float4*>(s_o + (w * 16 + r) * Cfg::kExchangeStride)[c];
      acc.x += wt * x.x;
      acc.y += wt * x.y;
      acc.z += wt * x.z;
      acc.w += wt * x.w;
      l += wt * s_l[w][r];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row0 + r;
    const int token = row / p.group, head = blockIdx.y * p.group + row % p.group;
    const float4 o = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    const float lse = l > 0.f ? (m * p.scale_log2 + __log2f(l)) * kLn2 : -INFINITY;
    if (p.direct) {
      // A row's kQuads threads: a whole warp at head dim 128, a half warp at 64.
      const unsigned lanes =
          kQuads >= 32 ? 0xffffffffu : ((1u << kQuads) - 1) << (threadIdx.x % 32 / kQuads * kQuads);
      WriteRow<kDim>(p, (sl.q_begin + token) * p.num_heads + head, c, lanes, o, lse);
      continue;
    }
    const int64_t pr = PartialRow(sl, split, token, head, p.num_heads);
    reinterpret_cast<float4*>(p.o_part + pr * kDim)[c] = o;
    if (c == 0) p.lse_part[pr] = lse;
  }
}

template <int kDim, int kSlices>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    DecodeSplitKernel(const __grid_constant__ DecodeParams<kSlices> p) {
  using Cfg = DecodeConfig<kDim>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* s_q = smem;
  unsigned char* s_stages = smem + Cfg::kQBytes;
  __shared__ float s_m[kDecodeWarps][16], s_l[kDecodeWarps][16];

  // The combine kernel may be placed once every CTA of this grid has started (it waits for
  // this grid's end before reading): with one wave that takes no slot a split CTA needs.
  LetDependentsLaunch();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group_id = lane >> 2, tig = lane & 3;
  const DecodeSlice sl = p.slices[FindSlice<&DecodeSlice::item_start>(p, blockIdx.x)];
  const int local = static_cast<int>(blockIdx.x) - sl.item_start;
  const int split = local % sl.splits, row0 = (local / sl.splits) * 16;
  const int kv_head = blockIdx.y, G = p.group, rows = sl.q_len * G;
  const int64_t q_stride = static_cast<int64_t>(p.num_heads) * kDim;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * kDim;

  // Step 1: the Q tile (packed row r: token r / G, head kv_head * G + r % G), zero past the
  // slice's rows; this thread's two rows' positions (-1 past the slice: they see nothing).
  for (int i = tid; i < 16 * Cfg::kChunks; i += kDecodeThreads) {
    const int r = i / Cfg::kChunks, c = i % Cfg::kChunks, row = row0 + r;
    const bool in = row < rows;
    const __nv_bfloat16* src = p.q + (sl.q_begin + (in ? row / G : 0)) * q_stride +
                               static_cast<int64_t>(kv_head * G + (in ? row % G : 0)) * kDim +
                               c * 8;
    CpAsync16(SmemAddr(s_q + SwizzledOffset<kDim>(r, c)), in ? src : p.q, in ? 16 : 0);
  }
  CpAsyncCommit();
  int32_t q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + group_id + 8 * h;
    q_pos[h] = row < rows ? p.q_pos[sl.q_begin + row / G] : kPadPosition;
  }

  // Step 2: this split's key tiles stream through the stages; a thread always copies the same
  // 16-byte chunk column. Keys past the slice are zero-filled (never read: a KV cache may hold
  // NaN there) and masked by their index.
  const int tile_begin = split * sl.tiles_per_split;
  const int num_tiles = max(0, min(sl.tiles_per_split, KeyTiles(sl.kv_len) - tile_begin));
  // Contiguous: key r at k_base + r * kv_stride. Paged: the pools' block 0 (row_offset below).
  const bool paged = p.block_table != nullptr;
  const int64_t head_offset = kv_head * kDim + (paged ? 0 : sl.kv_begin * kv_stride);
  const __nv_bfloat16* k_base = p.k + head_offset;
  const __nv_bfloat16* v_base = p.v + head_offset;
  // Element offset of key `key` of the slice from k_base / v_base.
  auto row_offset = [&](int key) -> int64_t {
    if (!paged) return static_cast<int64_t>(key) * kv_stride;
    const int32_t block = __ldg(p.block_table + sl.table_begin + key / p.block_tokens);
    return static_cast<int64_t>(block) * p.block_stride +
           static_cast<int64_t>(key % p.block_tokens) * kv_stride;
  };
  const int32_t* kpos_base = p.k_pos + sl.kv_begin;
  constexpr int kRowsPerPass = kDecodeThreads / Cfg::kChunks;
  const int ld_chunk = tid % Cfg::kChunks, ld_row = tid / Cfg::kChunks;
  auto load_tile = [&](int j) {
    const int key0 = (tile_begin + j) * kDecodeBlockN;
    unsigned char* st = s_stages + (j % kDecodeStages) * Cfg::kStageBytes;
#pragma unroll
    for (int i = 0; i < kDecodeBlockN / kRowsPerPass; ++i) {
      const int r = ld_row + i * kRowsPerPass;
      const bool in = key0 + r < sl.kv_len;
      const int64_t off = in ? row_offset(key0 + r) + ld_chunk * 8 : 0;
      const uint32_t so = SwizzledOffset<kDim>(r, ld_chunk);
      CpAsync16(SmemAddr(st + so), in ? k_base + off : p.k, in ? 16 : 0);
      CpAsync16(SmemAddr(st + Cfg::kTileBytes + so), in ? v_base + off : p.v, in ? 16 : 0);
    }
    if (tid < kDecodeBlockN) {
      const bool in = key0 + tid < sl.kv_len;
      CpAsync4(SmemAddr(st + 2 * Cfg::kTileBytes + tid * 4), in ? kpos_base + key0 + tid : p.k_pos,
               in ? 4 : 0);
    }
  };
#pragma unroll
  for (int j = 0; j < kDecodeStages - 1; ++j) {
    if (j < num_tiles) load_tile(j);
    CpAsyncCommit();
  }
  CpAsyncWait<kDecodeStages - 1>();  // the Q group
  __syncthreads();
  uint32_t q_regs[kDim / 16][4];
  {
    const uint32_t q_addr = SmemAddr(s_q) + ((lane & 7) + ((lane >> 3) & 1) * 8) * kDim * 2;
    const uint32_t q_swz = static_cast<uint32_t>(((lane >> 4) ^ (lane & 7)) * 16);
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) LdMatrixX4(q_regs[kk], q_addr + (q_swz ^ (kk << 5)));
  }

  float o_acc[kDim / 8][4];
#pragma unroll
  for (int i = 0; i < kDim / 8; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  float m_row[2] = {-INFINITY, -INFINITY}, l_row[2] = {0.f, 0.f};
  // ldmatrix geometry as the prefill kernel's (mma_kernel.cuh): rows differ from k_row /
  // v_row by multiples of 8, so the swizzle is one XOR with a per-thread constant.
  const int k_row = warp * 16 + (lane & 7) + (lane >> 4) * 8, k_half = (lane >> 3) & 1;
  const int v_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, v_half = lane >> 4;
  const uint32_t k_swz = static_cast<uint32_t>((k_half ^ (lane & 7)) * 16);
  const uint32_t v_swz = static_cast<uint32_t>((v_half ^ (lane & 7)) * 16);

  for (int j = 0; j < num_tiles; ++j) {
    // Step 2.1: tile j has landed, and every warp is done with tile j - 1, whose stage the
    // prefetch of tile j + kDecodeStages - 1 now refills.
    CpAsyncWait<kDecodeStages - 2>();
    __syncthreads();
    if (j + kDecodeStages - 1 < num_tiles) load_tile(j + kDecodeStages - 1);
    CpAsyncCommit();
    const unsigned char* st = s_stages + (j % kDecodeStages) * Cfg::kStageBytes;
    const uint32_t tk_addr = SmemAddr(st) + k_row * kDim * 2;
    const uint32_t tv_addr = SmemAddr(st + Cfg::kTileBytes) + v_row * kDim * 2;
    const int32_t* tpos = reinterpret_cast<const int32_t*>(st + 2 * Cfg::kTileBytes);

    // Step 2.2: S = Q K^T over this warp's 16 keys of the tile.
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      uint32_t b[4];
      LdMatrixX4(b, tk_addr + (k_swz ^ (kk << 5)));
      Mma16816(s_acc[0], q_regs[kk], b[0], b[1]);
      Mma16816(s_acc[1], q_regs[kk], b[2], b[3]);
    }

    // Step 2.3: the mask, on every tile (a decode tile is cheap next to its loads).
    const int key0 = (tile_begin + j) * kDecodeBlockN;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int c = warp * 16 + (e >> 2) * 8 + tig * 2 + (e & 1);
      const int32_t kp = tpos[c], qp = q_pos[(e >> 1) & 1];
      const bool visible = key0 + c < sl.kv_len && kp >= 0 && qp >= 0 && (!p.causal || kp <= qp);
      if (!visible) s_acc[e >> 2][e & 3] = -INFINITY;
    }

    // Step 2.4: online softmax (online_softmax.h's step, base 2, the scale in the FMA).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(fmaxf(s_acc[0][2 * h], s_acc[0][2 * h + 1]),
                       fmaxf(s_acc[1][2 * h], s_acc[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const OnlineSoftmax<float>::Step step = OnlineSoftmax<float>::Next(
          m_row[h] * p.scale_log2, mx * p.scale_log2, [](float x) { return FastExp2(x); });
      m_row[h] = fmaxf(m_row[h], mx);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s_acc[nt][e] = FastExp2(fmaf(s_acc[nt][e], p.scale_log2, -step.offset));
          sum += s_acc[nt][e];
        }
      }
      l_row[h] = l_row[h] * step.alpha + sum;
#pragma unroll
      for (int dt = 0; dt < kDim / 8; ++dt) {
        o_acc[dt][2 * h] *= step.alpha;
        o_acc[dt][2 * h + 1] *= step.alpha;
      }
    }

    // Step 2.5: O += P V, P re-packed as one bf16 A fragment (the warp's 16 keys).
    uint32_t a[4] = {PackBf16(s_acc[0][0], s_acc[0][1]), PackBf16(s_acc[0][2], s_acc[0][3]),
                     PackBf16(s_acc[1][0], s_acc[1][1]), PackBf16(s_acc[1][2], s_acc[1][3])};
#pragma unroll
    for (int dd = 0; dd < kDim / 16; ++dd) {
      uint32_t b[4];
      LdMatrixX4Trans(b, tv_addr + (v_swz ^ (dd << 5)));
      Mma16816(o_acc[2 * dd], a, b[0], b[1]);
      Mma16816(o_acc[2 * dd + 1], a, b[2], b[3]);
    }
  }

  // Step 3: every warp's (m, l, O) into shared memory (the stages are free once every copy
  // has landed and every warp has left the loop), then one partial per row to the workspace.
  CpAsyncWait<0>();
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(s_stages);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = group_id + 8 * h;
    if (tig == 0) {
      s_m[warp][r] = m_row[h];
      s_l[warp][r] = l;
    }
    float* orow = s_o + (warp * 16 + r) * Cfg::kExchangeStride + tig * 2;
#pragma unroll
    for (int dt = 0; dt < kDim / 8; ++dt) {
      *reinterpret_cast<float2*>(orow + dt * 8) =
          make_float2(o_acc[dt][2 * h], o_acc[dt][2 * h + 1]);
    }
  }
  __syncthreads();
  StoreSplit<kDim>(p, sl, split, row0, s_o, s_m, s_l);
}

// ---- the combine kernel --------------------------------------------------------------------

// kParts CTAs per (token, head) of a slice, each a 1 / kParts share of the row's columns: the
// exact merge of its splits (weights relative to the largest LSE; a -inf split weighs 0, and
// its O, written 0, adds nothing), split groups of kDim / 4 / kParts threads each summing every
// kGroups-th split, then the output mode. More parts spread a few rows of many splits (a batch
// of one) over more SMs; the running merge (kOutMergeF32) reads and rewrites the row's LSE, so
// it takes one part. Launched as a programmatic dependent of the split kernel: it may start
// while the split kernel's last CTAs run, and waits for their results before its first read.
template <int kDim, int kSlices, int kParts>
__global__ void __launch_bounds__(kCombineThreads)
    DecodeCombineKernel(const __grid_constant__ DecodeParams<kSlices> p) {
  constexpr int kLanes = kDim / 4 / kParts;
  constexpr int kGroups = kCombineThreads / kLanes;
  __shared__ float4 s_acc[kGroups][kLanes];
  __shared__ float s_lse[kMaxSplits];
  __shared__ float s_wsum[kGroups];
  __shared__ float s_max[kCombineThreads / 32];
  WaitForPrecedingGrids();
  const int pair = static_cast<int>(blockIdx.x) / kParts, part = blockIdx.x % kParts;
  const DecodeSlice sl = p.slices[FindSlice<&DecodeSlice::pair_start>(p, pair)];
  const int local = pair - sl.pair_start;
  const int token = local / p.num_heads, head = local % p.num_heads;

  // Step 1: every split's LSE into shared memory, and the largest.
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < sl.splits; j += kCombineThreads) {
    s_lse[j] = p.lse_part[PartialRow(sl, j, token, head, p.num_heads)];
    mx = fmaxf(mx, s_lse[j]);
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (threadIdx.x % 32 == 0) s_max[threadIdx.x / 32] = mx;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kCombineThreads / 32; ++w) mx = fmaxf(mx, s_max[w]);
  const bool empty = mx == -INFINITY;

  // Step 2: each group's weighted sum of its splits' O; no branch on the weight, so the
  // unrolled loads of several splits are in flight together.
  const int g = threadIdx.x / kLanes, c = threadIdx.x % kLanes, column = part * kLanes + c;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  const int splits = empty ? 0 : sl.splits;
#pragma unroll 4
  for (int j = g; j < splits; j += kGroups) {
    const float w = __expf(s_lse[j] - mx);
    const float4 x = reinterpret_cast<const float4*>(
        p.o_part + PartialRow(sl, j, token, head, p.num_heads) * kDim)[column];
    acc.x += w * x.x;
    acc.y += w * x.y;
    acc.z += w * x.z;
    acc.w += w * x.w;
    wsum += w;
  }
  s_acc[g][c] = acc;
  if (c == 0) s_wsum[g] = wsum;
  __syncthreads();
  if (threadIdx.x >= kLanes) return;

  // Step 3: the groups summed (the largest split weighs 1, so wsum >= 1 unless empty).
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
  wsum = 0.f;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    acc.x += s_acc[k][c].x;
    acc.y += s_acc[k][c].y;
    acc.z += s_acc[k][c].z;
    acc.w += s_acc[k][c].w;
    wsum += s_wsum[k];
  }
  const float inv = empty ? 0.f : 1.f / wsum;
  const float4 o = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  const unsigned lanes = kLanes >= 32 ? 0xffffffffu : (1u << kLanes) - 1;
  WriteRow<kDim>(p, (sl.q_begin + token) * p.num_heads + head, column, lanes, o,
                 empty ? -INFINITY : mx + __logf(wsum));
}

// ---- host side ---------------------------------------------------------------------------

// The split kernel's shared-memory opt-in (once per head dim) and its CTAs per SM.
struct SplitKernelInfo {
  cudaError_t attr_error;
  int ctas_per_sm;
};
template <int kDim, int kSlices>
const SplitKernelInfo& SplitKernel() {
  static const SplitKernelInfo info = [] {
    constexpr int kSmem = DecodeConfig<kDim>::kSmemBytes;
    SplitKernelInfo i{cudaFuncSetAttribute(DecodeSplitKernel<kDim, kSlices>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                      1};
    if (i.attr_error == cudaSuccess && cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                           &i.ctas_per_sm, DecodeSplitKernel<kDim, kSlices>,
                                           kDecodeThreads, kSmem) != cudaSuccess) {
      i.ctas_per_sm = 1;
    }
    cudaGetLastError();  // a failure is reported at launch, through attr_error
    i.ctas_per_sm = std::max(1, i.ctas_per_sm);
    return i;
  }();
  return info;
}

// Peak DRAM bytes per second per SM, from the memory clock and bus width (double data rate):
// 25 GB/s on an H100 SXM (3.35 TB/s), 37 on an H200 (4.8 TB/s); 0 where the device does not say.
// Under MIG the SM count is the instance's but the bus the whole GPU's: the rate is overstated
// there, and a small instance takes two CTAs per SM (CPFILL_DECODE_CTAS_PER_SM=1 forces one).
double DramBytesPerSecondPerSm() {
  static const double rate = [] {
    int device = 0, khz = 0, bits = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      cudaGetLastError();
      return 0.0;
    }
    return 2.0 * khz * 1e3 * (bits / 8.0) / SmCount();
  }();
  return rate;
}

// Split CTAs per SM for contiguous K/V: one where an SM's share of the DRAM bandwidth is what
// one CTA's two tiles in flight cover (fewer, longer splits; an SM's two CTAs finished up to 2 µs
// after a lone one: 1.3-7% faster on 10 of 12 shapes at 32K-128K on an H100), two above
// 30 GB/s per SM (an H200: two were 1.02-1.16x faster on 9 of 12 shapes at 32K-128K, 0.99-1.00x
// on the other 3; bench/RESULTS.md 2026-11-28).
int ContiguousCtasPerSm() { return DramBytesPerSecondPerSm() > 30e9 ? 2 : 1; }

// The split CTAs a launch aims at: one wave (fewer SMs while a communication kernel runs beside
// it, as the Hopper kernel leaves them). Paged K/V takes as many per SM as fit, where every
// tile's copies wait on block-table reads: one per SM was up to 1.6x slower there on an H100
// (bench/RESULTS.md, 2026-11-27).
int64_t Slots(const CudaAttentionArgs& a) {
  static const int knob = static_cast<int>(knobs::Int(knobs::kDecodeCtasPerSm));
  int sms = SmCount();
  if (a.communication_in_flight) sms = std::max(1, sms - SmsForCommunication());
  const int fit = a.shape.head_dim == 64 ? SplitKernel<64, kMaxDecodeSlices>().ctas_per_sm
                                         : SplitKernel<128, kMaxDecodeSlices>().ctas_per_sm;
  const int per_sm = knob != 0 ? knob : a.paged == nullptr ? ContiguousCtasPerSm() : fit;
  return static_cast<int64_t>(sms) * std::min(per_sm, fit);
}

struct DecodePlan {
  std::vector<DecodeSlice> slices;  // the slices with query rows, in call order
  int64_t partial_rows = 0;
};

// CTAs of the split kernel for `group` when every split holds at most `tiles_per_split` tiles.
int64_t CountCtas(const CudaAttentionArgs& a, std::span<const SequenceSlice> group,
                  int64_t tiles_per_split) {
  int64_t ctas = 0;
  for (const SequenceSlice& s : group) {
    ctas += MTiles(s.q_len, a.shape.group_size()) *
            ((KeyTiles(s.kv_len) + tiles_per_split - 1) / tiles_per_split);
  }
  return ctas * a.shape.num_kv_heads;
}

// Key tiles per split for one launch's slices: the fewest that keep its CTAs within one wave (a
// second, partly filled wave would cost a whole CTA's time; CPFILL_DECODE_SPLIT_WAVES aims at
// more, shorter splits), at least kMinTilesPerSplit.
int64_t TilesPerSplit(const CudaAttentionArgs& a, std::span<const SequenceSlice> group) {
  static const int64_t waves = knobs::Int(knobs::kDecodeSplitWaves);
  const int64_t slots = Slots(a) * waves;
  int64_t total = 0, longest = 1;
  for (const SequenceSlice& s : group) {
    total += int64_t{MTiles(s.q_len, a.shape.group_size())} * KeyTiles(s.kv_len);
    longest = std::max<int64_t>(longest, KeyTiles(s.kv_len));
  }
  total *= a.shape.num_kv_heads;
  int64_t tps = std::max<int64_t>(
      {kMinTilesPerSplit, (total + slots - 1) / slots, (longest + kMaxSplits - 1) / kMaxSplits});
  while (tps < longest && CountCtas(a, group, tps) > slots) tps += std::max<int64_t>(1, tps / 32);
  return tps;
}

// The slices with query rows, launched kMaxDecodeSlices at a time: each launch's splits sized
// for a wave of its own (the launches run one after another), then each slice's tiles spread
// evenly over its splits.
DecodePlan PlanDecode(const CudaAttentionArgs& a) {
  std::vector<SequenceSlice> rows;
  for (int64_t i = 0; i < a.num_slices; ++i) {
    if (a.slices[i].q_len > 0) rows.push_back(a.slices[i]);
  }
  DecodePlan plan;
  for (size_t first = 0; first < rows.size(); first += kMaxDecodeSlices) {
    const std::span<const SequenceSlice> group(
        rows.data() + first, std::min<size_t>(kMaxDecodeSlices, rows.size() - first));
    const int64_t tps = TilesPerSplit(a, group);
    for (const SequenceSlice& s : group) {
      const int32_t tiles = KeyTiles(s.kv_len);
      int32_t splits = static_cast<int32_t>((tiles + tps - 1) / tps);
      const int32_t even = splits == 0 ? 0 : (tiles + splits - 1) / splits;
      splits = even == 0 ? 0 : (tiles + even - 1) / even;
      const int64_t table_begin = a.paged == nullptr ? 0 : a.paged->TableBegin(s.kv_begin);
      plan.slices.push_back({s.q_begin, s.kv_begin, static_cast<int32_t>(s.q_len),
                             static_cast<int32_t>(s.kv_len), 0, splits, even,
                             static_cast<int32_t>(plan.partial_rows), 0,
                             static_cast<int32_t>(std::max<int64_t>(0, table_begin))});
      plan.partial_rows += int64_t{splits} * s.q_len;
    }
  }
  return plan;
}

size_t PartialBytes(const CudaAttentionArgs& a, int64_t partial_rows) {
  return static_cast<size_t>(partial_rows) * a.shape.num_heads * (a.shape.head_dim + 1) *
         sizeof(float);
}

// The combine's CTAs per output row (DecodeCombineKernel): the fewest of 1, 2 or 4 that give
// every SM a CTA (CPFILL_DECODE_COMBINE_PARTS chooses for measurement); 1 for the running merge.
int CombineParts(const DecodeCommon& p, int64_t pairs) {
  static const int knob = static_cast<int>(knobs::Int(knobs::kDecodeCombineParts));
  if (p.out_mode == kOutMergeF32) return 1;
  if (knob != 0) return knob >= 4 ? 4 : knob >= 2 ? 2 : 1;
  const int64_t sms = SmCount();
  return pairs >= sms ? 1 : 2 * pairs >= sms ? 2 : 4;
}

template <int kDim, int kSlices, int kParts>
absl::Status LaunchCombine(const DecodeParams<kSlices>& p, int32_t pairs, cudaStream_t stream) {
  // The combine as a programmatic dependent launch: its CTAs are placed once every split CTA
  // has started (the split kernel triggers at its start), hiding the launch gap.
  CPFILL_CUDA_CHECK(LaunchAsDependent(DecodeCombineKernel<kDim, kSlices, kParts>,
                                      dim3(pairs * kParts), dim3(kCombineThreads), 0, stream, p));
  return absl::OkStatus();
}

template <int kDim, int kSlices>
absl::Status LaunchGroup(const DecodeParams<kSlices>& p, int32_t ctas, int32_t pairs,
                         int num_kv_heads, cudaStream_t stream) {
  if (ctas > 0) {
    CPFILL_CUDA_CHECK((SplitKernel<kDim, kSlices>().attr_error));
    DecodeSplitKernel<kDim, kSlices>
        <<<dim3(ctas, num_kv_heads), kDecodeThreads, DecodeConfig<kDim>::kSmemBytes, stream>>>(p);
    CPFILL_CUDA_CHECK(cudaGetLastError());
  }
  if (p.direct) return absl::OkStatus();
  switch (CombineParts(p, pairs)) {
    case 4:
      return LaunchCombine<kDim, kSlices, 4>(p, pairs, stream);
    case 2:
      return LaunchCombine<kDim, kSlices, 2>(p, pairs, stream);
    default:
      return LaunchCombine<kDim, kSlices, 1>(p, pairs, stream);
  }
}

// The plan's slices kSlices at a time (PlanDecode sized each group's splits for a wave of its
// own), each group a split launch and, unless every slice is one split, its combine.
template <int kSlices>
absl::Status LaunchGroups(const DecodeCommon& common, std::span<const DecodeSlice> slices,
                          const AttentionShape& shape, cudaStream_t stream) {
  static_assert(kMaxDecodeSlices % kSlices == 0, "groups of PlanDecode's size or smaller");
  DecodeParams<kSlices> p{};
  static_cast<DecodeCommon&>(p) = common;
  for (size_t first = 0; first < slices.size(); first += kSlices) {
    const size_t count = std::min<size_t>(kSlices, slices.size() - first);
    int64_t ctas = 0, pairs = 0;
    p.direct = 1;
    for (size_t i = 0; i < count; ++i) {
      DecodeSlice d = slices[first + i];
      p.direct &= d.splits == 1 ? 1 : 0;  // a slice without keys still needs the combine's zeros
      d.item_start = static_cast<int32_t>(ctas);
      d.pair_start = static_cast<int32_t>(pairs);
      ctas += int64_t{MTiles(d.q_len, p.group)} * d.splits;
      pairs += int64_t{d.q_len} * p.num_heads;
      p.slices[i] = d;
    }
    p.num_slices = static_cast<int32_t>(count);
    CPFILL_CHECK_ARG(ctas < (int64_t{1} << 31) && pairs < (int64_t{1} << 31),
                     "decode attention: ", ctas, " CTAs exceed one launch");
    CPFILL_RETURN_IF_ERROR(
        shape.head_dim == 64
            ? LaunchGroup<64>(p, static_cast<int32_t>(ctas), static_cast<int32_t>(pairs),
                              shape.num_kv_heads, stream)
            : LaunchGroup<128>(p, static_cast<int32_t>(ctas), static_cast<int32_t>(pairs),
                               shape.num_kv_heads, stream));
  }
  return absl::OkStatus();
}

}  // namespace

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    sms = 1;
  }
  return sms;
}

bool DecodeKernelCanRun(const CudaAttentionArgs& a) {
  static const bool enabled = knobs::Bool(knobs::kDecodeKernel);
  // Paged K/V has no other reader: the knob chooses only for contiguous rows.
  if ((!enabled && a.paged == nullptr) || !SupportedHeadDim(a.shape.head_dim) ||
      a.shape.num_kv_heads <= 0 || a.shape.num_heads % a.shape.num_kv_heads != 0 ||
      a.slices == nullptr || !Aligned16(a.q) || !Aligned16(a.k) || !Aligned16(a.v)) {
    return false;
  }
  bool any_rows = false;
  for (int64_t i = 0; i < a.num_slices; ++i) any_rows |= a.slices[i].q_len > 0;
  return any_rows;
}

bool DecodeAttentionApplies(const CudaAttentionArgs& a) {
  if (!DecodeKernelCanRun(a)) return false;
  // Paged K/V: any rows per slice (a shared prefix's root under a batch of decode rows,
  // prefix_batched.h FindSharedBlocks), unless the Hopper kernel reads the long ones.
  if (a.paged != nullptr) return !PagedPrefillOnHopper(a);
  for (int64_t i = 0; i < a.num_slices; ++i) {
    if (a.slices[i].q_len > kMaxDecodeQueryRows) return false;
  }
  return true;
}

size_t DecodeWorkspaceBytes(const CudaAttentionArgs& a) {
  return PartialBytes(a, PlanDecode(a).partial_rows);
}

absl::Status LaunchDecodeAttention(const CudaAttentionArgs& a, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  const DecodePlan plan = PlanDecode(a);
  const int64_t part_values = plan.partial_rows * a.shape.num_heads;
  CPFILL_CHECK_ARG(workspace_bytes >= PartialBytes(a, plan.partial_rows),
                   "decode attention: ", workspace_bytes, " workspace bytes, ",
                   PartialBytes(a, plan.partial_rows), " needed");
  DecodeCommon p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.q_pos = a.q_pos;
  p.k_pos = a.k_pos;
  p.o_part = static_cast<float*>(workspace);
  p.lse_part = p.o_part + part_values * a.shape.head_dim;
  p.o = a.o;
  p.lse = a.lse;
  if (a.paged != nullptr) {
    p.block_table = a.paged->table;
    p.block_stride = a.paged->block_stride_bytes / static_cast<int64_t>(sizeof(__nv_bfloat16));
    p.block_tokens = a.paged->block_tokens;
  }
  p.num_heads = a.shape.num_heads;
  p.num_kv_heads = a.shape.num_kv_heads;
  p.group = a.shape.group_size();
  p.causal = a.shape.causal ? 1 : 0;
  p.out_mode = a.output == OutputMode::kBfloat16  ? kOutBf16
               : a.output == OutputMode::kFloat32 ? kOutF32
                                                  : kOutMergeF32;
  p.scale_log2 = a.shape.softmax_scale * kLog2e;
  // One launch pair (split, combine) per kMaxDecodeSlices slices, in the smaller parameter
  // block where the slices fit it.
  return plan.slices.size() <= kFewDecodeSlices
             ? LaunchGroups<kFewDecodeSlices>(p, plan.slices, a.shape, stream)
             : LaunchGroups<kMaxDecodeSlices>(p, plan.slices, a.shape, stream);
}

}  // namespace cpfill::attention::cuda::internal
