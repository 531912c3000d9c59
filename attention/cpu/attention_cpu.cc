// PartialAttentionCpu: blocked online-softmax attention in fp32 (FlashAttention's algorithm, laid
// out for CPU SIMD).
//
// Work decomposition. A work item is (slice, kv head, query tile). A query tile is kTileTokens
// tokens x group_size query heads: the GQA group sharing one KV head is folded into the M
// dimension (row m = token * group_size + head_in_group), so every K/V tile loaded is reused by
// the whole group. Items are independent (they write disjoint O rows) and go to the ThreadPool.
//
// Per item, for each key tile of kKeyTile keys:
//   1. skip it when the mask hides it entirely (no valid key, or causal and the smallest key
//      position is past the largest query position of the tile);
//   2. S = Q K^T with K transposed to [head_dim][kKeyTile], so the inner loop is FMAs over
//      contiguous keys with one broadcast query element (Q is pre-scaled by
//      softmax_scale * log2(e), so the softmax runs in base 2);
//   3. apply the element mask only when the tile is not fully visible;
//   4. online softmax: running max m and sum l per row, P = exp2(S - m), and the correction
//      factor alpha = exp2(m_old - m_new) that rescales the accumulator (online_softmax.h);
//   5. O = alpha * O + P V, over contiguous head_dim.
// Rows that saw no key keep m = -inf, l = 0 and end as O = 0, LSE = -inf.
//
// The microkernels use GCC/Clang vector extensions rather than intrinsics: the same source
// compiles to AVX-512, AVX2 or SSE from -march, and the accumulators stay in registers.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "attention/attention.h"
#include "attention/online_softmax.h"
#include "base/status.h"

namespace cpfill::attention {
namespace {

// ---- SIMD configuration ---------------------------------------------------------------------

#if defined(__AVX512F__)
constexpr int kVecWidth = 16;  // floats per vector register
constexpr int kTileRows = 6;   // query rows per microkernel call (register block)
constexpr int kQkVecs = 4;     // key vectors per QK call: 6 x 4 accumulators of 32 zmm registers
constexpr int kPvVecs = 4;     // head_dim vectors per PV microkernel call
#elif defined(__AVX__)
constexpr int kVecWidth = 8;
constexpr int kTileRows = 4;
constexpr int kQkVecs = 2;  // 16 ymm registers: 8 accumulators + loads
constexpr int kPvVecs = 2;
#else
constexpr int kVecWidth = 4;
constexpr int kTileRows = 4;
constexpr int kQkVecs = 2;
constexpr int kPvVecs = 2;
#endif

typedef float VecF __attribute__((vector_size(kVecWidth * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kVecWidth * sizeof(int32_t))));
static_assert(sizeof(VecF) == sizeof(VecI), "mask and data vectors must have the same lanes");

// Keys per tile. 64 keys x head_dim 128 x 4 B = 32 KiB for each of K^T and V: both stay in L2,
// and the QK row block reads K^T from L1 as it streams.
constexpr int kKeyTile = 64;
// Target rows (tokens x group heads) per query tile: big enough to amortise the K/V tile loads,
// small enough that Q, O and S of the tile fit in L2.
constexpr int kTargetTileRows = 128;
constexpr int kKeyVecs = kKeyTile / kVecWidth;
static_assert(kKeyTile % (kQkVecs * kVecWidth) == 0, "QK microkernel must tile the key tile");

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline VecF Splat(float x) { return VecF{} + x; }
inline VecF Load(const float* p) { return *reinterpret_cast<const VecF*>(p); }
inline void Store(float* p, VecF v) { *reinterpret_cast<VecF*>(p) = v; }

inline float HorizontalMax(VecF v) {
  float r = v[0];
  for (int i = 1; i < kVecWidth; ++i) r = std::max(r, v[i]);
  return r;
}
inline float HorizontalSum(VecF v) {
  float r = v[0];
  for (int i = 1; i < kVecWidth; ++i) r += v[i];
  return r;
}

// 2^x for x <= 0 (larger x is clamped at 127). Arguments at or below -127 give exactly 0, which
// is what makes exp2(-inf) = 0 and keeps masked keys out of the sum. Cephes exp2f polynomial on
// [-0.5, 0.5], relative error ~2e-7.
inline VecF Exp2(VecF x) {
  const VecF lo = Splat(-127.0f);
  const VecF hi = Splat(127.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest integer: adding 1.5 * 2^23 pushes the fraction out of the mantissa.
  const VecF magic = Splat(12582912.0f);
  const VecF n = (x + magic) - magic;
  const VecF f = x - n;
  VecF p = Splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  // n = -127 yields the bit pattern 0, i.e. 2^n is taken as exactly 0.
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  return p * std::bit_cast<VecF>(bits);
}

// ---- Scratch memory -------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// A 64-byte aligned float buffer that only grows, kept per thread across calls so the kernel does
// not allocate per work item.
class AlignedBuffer {
 public:
  float* Get(size_t n) {
    if (n > capacity_) {
      const size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
      data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      capacity_ = bytes / sizeof(float);
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float, FreeDeleter> data_;
  size_t capacity_ = 0;
};

struct Scratch {
  AlignedBuffer q;      // [rows_padded][head_dim], pre-scaled queries of the tile
  AlignedBuffer kt;     // [head_dim][kKeyTile], the key tile transposed
  AlignedBuffer v;      // [kKeyTile][dim_padded], the value tile, zero-padded columns
  AlignedBuffer s;      // [rows_padded][kKeyTile], scores, then probabilities
  AlignedBuffer o;      // [rows_padded][dim_padded], unnormalised output accumulator
  AlignedBuffer m;      // [rows_padded] running max (base-2 units)
  AlignedBuffer l;      // [rows_padded] running sum
  AlignedBuffer alpha;  // [rows_padded] rescale factor of the current key tile
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// ---- Microkernels ---------------------------------------------------------------------------

// s[r][0 : NV*W) = sum_d q[r][d] * kt[d][0 : NV*W) for r < kTileRows.
// q: row stride head_dim; kt and s: row stride kKeyTile.
template <int NV>
inline void QkMicrokernel(const float* __restrict q, int head_dim, const float* __restrict kt,
                          float* __restrict s) {
  VecF acc[kTileRows][NV];
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = Splat(0.0f);
  }
  for (int d = 0; d < head_dim; ++d) {
    VecF kv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) kv[v] = Load(kt + d * kKeyTile + v * kVecWidth);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const float qr = q[r * head_dim + d];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += qr * kv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) Store(s + r * kKeyTile + v * kVecWidth, acc[r][v]);
  }
}

// o[r][0 : NV*W) = alpha[r] * o[r][0 : NV*W) + sum_{j < num_keys} p[r][j] * v[j][0 : NV*W).
// p: row stride kKeyTile; v and o: row stride ld.
template <int NV>
inline void PvMicrokernel(const float* __restrict p, const float* __restrict v, int ld,
                          int num_keys, const float* __restrict alpha, float* __restrict o) {
  VecF acc[kTileRows][NV];
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    const float a = alpha[r];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[r][c] = Load(o + r * ld + c * kVecWidth) * a;
  }
  for (int j = 0; j < num_keys; ++j) {
    VecF vv[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) vv[c] = Load(v + j * ld + c * kVecWidth);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const float pr = p[r * kKeyTile + j];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[r][c] += pr * vv[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) Store(o + r * ld + c * kVecWidth, acc[r][c]);
  }
}

// Runs the PV microkernel over all dim_padded columns of one row block: full kPvVecs chunks,
// then the remainder (head_dim 40 pads to 48 = 3 AVX-512 vectors, say).
inline void PvRowBlock(const float* p, const float* v, int dim_padded, int num_keys,
                       const float* alpha, float* o) {
  constexpr int kChunk = kPvVecs * kVecWidth;
  int col = 0;
  for (; col + kChunk <= dim_padded; col += kChunk) {
    PvMicrokernel<kPvVecs>(p, v + col, dim_padded, num_keys, alpha, o + col);
  }
  switch ((dim_padded - col) / kVecWidth) {
    case 0:
      break;
    case 1:
      PvMicrokernel<1>(p, v + col, dim_padded, num_keys, alpha, o + col);
      break;
    case 2:
      PvMicrokernel<2>(p, v + col, dim_padded, num_keys, alpha, o + col);
      break;
    case 3:
      PvMicrokernel<3>(p, v + col, dim_padded, num_keys, alpha, o + col);
      break;
    default:
      // Unreachable: the remainder is below kPvVecs <= 4 vectors.
      std::abort();
  }
}

// ---- Plan -----------------------------------------------------------------------------------

// Summary of one key tile, shared by every kv head and query tile that visits it.
struct KeyTileInfo {
  int32_t min_pos;  // smallest non-padding position (INT32_MAX when none)
  int32_t max_pos;  // largest non-padding position (-1 when none)
  bool all_valid;   // full tile (kKeyTile keys) with no padding key
};

struct WorkItem {
  int64_t slice;
  int64_t token_begin;  // first query token of the tile
  int32_t num_tokens;
  int32_t kv_head;
};

struct Plan {
  const AttentionParams* p;
  int group_size;
  int head_dim;
  int dim_padded;                          // head_dim rounded up to whole vectors
  int tile_tokens;                         // query tokens per tile
  float q_scale;                           // softmax_scale * log2(e)
  std::vector<int64_t> slice_tile_offset;  // first KeyTileInfo of each slice
  std::vector<KeyTileInfo> key_tiles;
  std::vector<WorkItem> items;
};

// Writes the empty-row convention (O = 0, LSE = -inf) for query rows [begin, end), all heads.
void WriteEmptyRows(const AttentionParams& p, int64_t begin, int64_t end) {
  const int64_t heads = p.shape.num_heads;
  std::fill(p.o + begin * heads * p.shape.head_dim, p.o + end * heads * p.shape.head_dim, 0.0f);
  std::fill(p.lse + begin * heads, p.lse + end * heads, kNegInf);
}

// Same, for the group_size heads of one kv head on one token.
void WriteEmptyGroup(const Plan& plan, int64_t token, int kv_head) {
  const AttentionParams& p = *plan.p;
  const int64_t head0 = token * p.shape.num_heads + int64_t{kv_head} * plan.group_size;
  std::fill(p.o + head0 * plan.head_dim, p.o + (head0 + plan.group_size) * plan.head_dim, 0.0f);
  std::fill(p.lse + head0, p.lse + head0 + plan.group_size, kNegInf);
}

// ---- One work item --------------------------------------------------------------------------

void RunItem(const Plan& plan, const WorkItem& item) {
  const AttentionParams& p = *plan.p;
  const SequenceSlice& slice = p.slices[item.slice];
  const int group = plan.group_size;
  const int head_dim = plan.head_dim;
  const int dim_padded = plan.dim_padded;
  const int num_kv_heads = p.shape.num_kv_heads;
  const int num_heads = p.shape.num_heads;
  const bool causal = p.shape.causal;
  const int num_tokens = item.num_tokens;
  const int rows = num_tokens * group;
  const int rows_padded = (rows + kTileRows - 1) / kTileRows * kTileRows;

  // Query positions of the tile; padding queries do not count towards the range.
  int32_t q_min = std::numeric_limits<int32_t>::max();
  int32_t q_max = -1;
  for (int i = 0; i < num_tokens; ++i) {
    const int32_t qp = p.q_pos[item.token_begin + i];
    if (qp >= 0) {
      q_min = std::min(q_min, qp);
      q_max = std::max(q_max, qp);
    }
  }
  if (q_max < 0) {
    for (int i = 0; i < num_tokens; ++i) WriteEmptyGroup(plan, item.token_begin + i, item.kv_head);
    return;
  }

  Scratch& sc = ThreadScratch();
  float* __restrict qs = sc.q.Get(size_t(rows_padded) * head_dim);
  float* __restrict kt = sc.kt.Get(size_t(head_dim) * kKeyTile);
  float* __restrict vs = sc.v.Get(size_t(kKeyTile) * dim_padded);
  float* __restrict ss = sc.s.Get(size_t(rows_padded) * kKeyTile);
  float* __restrict os = sc.o.Get(size_t(rows_padded) * dim_padded);
  float* __restrict row_max = sc.m.Get(rows_padded);
  float* __restrict row_sum = sc.l.Get(rows_padded);
  float* __restrict alpha = sc.alpha.Get(rows_padded);

  // Gather Q: the group's heads are contiguous in q for one token, so each token is one copy.
  // Padding rows of the register block are zero: finite scores, results discarded.
  for (int i = 0; i < num_tokens; ++i) {
    const float* src =
        p.q + ((item.token_begin + i) * num_heads + int64_t{item.kv_head} * group) * head_dim;
    float* dst = qs + size_t(i) * group * head_dim;
    for (int e = 0; e < group * head_dim; ++e) dst[e] = src[e] * plan.q_scale;
  }
  std::fill(qs + size_t(rows) * head_dim, qs + size_t(rows_padded) * head_dim, 0.0f);
  std::fill(os, os + size_t(rows_padded) * dim_padded, 0.0f);
  std::fill(row_max, row_max + rows_padded, kNegInf);
  std::fill(row_sum, row_sum + rows_padded, 0.0f);
  // Value columns past head_dim stay zero for every tile; set them once.
  if (dim_padded > head_dim) std::fill(vs, vs + size_t(kKeyTile) * dim_padded, 0.0f);

  const int64_t num_key_tiles = (slice.kv_len + kKeyTile - 1) / kKeyTile;
  const KeyTileInfo* tiles = plan.key_tiles.data() + plan.slice_tile_offset[item.slice];
  alignas(64) int32_t key_pos[kKeyTile];

  for (int64_t t = 0; t < num_key_tiles; ++t) {
    const KeyTileInfo& info = tiles[t];
    if (info.max_pos < 0) continue;                // all padding
    if (causal && info.min_pos > q_max) continue;  // every key is in every query's future
    const int64_t key0 = slice.kv_begin + t * kKeyTile;
    const int num_keys = static_cast<int>(std::min<int64_t>(kKeyTile, slice.kv_len - t * kKeyTile));
    const bool fully_visible = info.all_valid && (!causal || info.max_pos <= q_min);

    // Transpose K into [head_dim][kKeyTile]; columns past num_keys are zero (masked below).
    for (int j = 0; j < num_keys; ++j) {
      const float* src = p.k + ((key0 + j) * num_kv_heads + item.kv_head) * head_dim;
      for (int d = 0; d < head_dim; ++d) kt[d * kKeyTile + j] = src[d];
    }
    if (num_keys < kKeyTile) {
      for (int d = 0; d < head_dim; ++d) {
        std::fill(kt + d * kKeyTile + num_keys, kt + (d + 1) * kKeyTile, 0.0f);
      }
    }
    for (int j = 0; j < num_keys; ++j) {
      const float* src = p.v + ((key0 + j) * num_kv_heads + item.kv_head) * head_dim;
      std::copy(src, src + head_dim, vs + size_t(j) * dim_padded);
    }

    // S = Q K^T (already in base-2 softmax units).
    for (int r = 0; r < rows_padded; r += kTileRows) {
      for (int c = 0; c < kKeyTile; c += kQkVecs * kVecWidth) {
        QkMicrokernel<kQkVecs>(qs + size_t(r) * head_dim, head_dim, kt + c,
                               ss + size_t(r) * kKeyTile + c);
      }
    }

    // Element mask, only where the tile is not fully visible. Padding and out-of-tile keys get
    // position -1, which no mask admits.
    if (!fully_visible) {
      for (int j = 0; j < kKeyTile; ++j) key_pos[j] = j < num_keys ? p.k_pos[key0 + j] : -1;
      const VecF neg_inf = Splat(kNegInf);
      for (int i = 0; i < num_tokens; ++i) {
        const int32_t qp = p.q_pos[item.token_begin + i];
        VecI visible[kKeyVecs];
        for (int v = 0; v < kKeyVecs; ++v) {
          const VecI kp = *reinterpret_cast<const VecI*>(key_pos + v * kVecWidth);
          visible[v] = causal ? ((kp >= 0) & (kp <= qp)) : (kp >= 0);
        }
        for (int g = 0; g < group; ++g) {
          float* srow = ss + size_t(i * group + g) * kKeyTile;
          for (int v = 0; v < kKeyVecs; ++v) {
            const VecF sv = Load(srow + v * kVecWidth);
            Store(srow + v * kVecWidth, visible[v] ? sv : neg_inf);
          }
        }
      }
    }

    // Online softmax update; S becomes P in place.
    for (int r = 0; r < rows_padded; ++r) {
      float* srow = ss + size_t(r) * kKeyTile;
      VecF mv = Load(srow);
      for (int v = 1; v < kKeyVecs; ++v) {
        const VecF x = Load(srow + v * kVecWidth);
        mv = x > mv ? x : mv;
      }
      // Scores are in base-2 units: the state update runs on exp2.
      const OnlineSoftmax<float>::Step st = OnlineSoftmax<float>::Next(
          row_max[r], HorizontalMax(mv), [](float x) { return std::exp2(x); });
      const VecF m_vec = Splat(st.offset);
      VecF sum = Splat(0.0f);
      for (int v = 0; v < kKeyVecs; ++v) {
        const VecF e = Exp2(Load(srow + v * kVecWidth) - m_vec);
        Store(srow + v * kVecWidth, e);
        sum += e;
      }
      alpha[r] = st.alpha;
      row_sum[r] = row_sum[r] * st.alpha + HorizontalSum(sum);
      row_max[r] = st.m;
    }

    // O = alpha * O + P V.
    for (int r = 0; r < rows_padded; r += kTileRows) {
      PvRowBlock(ss + size_t(r) * kKeyTile, vs, dim_padded, num_keys, alpha + r,
                 os + size_t(r) * dim_padded);
    }
  }

  // Normalise and write. LSE = ln(sum 2^(s2)) = (m + log2 l) * ln 2 in base-2 score units.
  for (int i = 0; i < num_tokens; ++i) {
    const int64_t token = item.token_begin + i;
    if (p.q_pos[token] < 0) {
      WriteEmptyGroup(plan, token, item.kv_head);
      continue;
    }
    for (int g = 0; g < group; ++g) {
      const int r = i * group + g;
      const int64_t head = token * num_heads + int64_t{item.kv_head} * group + g;
      float* __restrict dst = p.o + head * head_dim;
      const float* src = os + size_t(r) * dim_padded;
      if (row_sum[r] > 0.0f) {
        const float inv = 1.0f / row_sum[r];
        for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * inv;
        p.lse[head] = (row_max[r] + std::log2(row_sum[r])) * kLn2;
      } else {
        std::fill(dst, dst + head_dim, 0.0f);
        p.lse[head] = kNegInf;
      }
    }
  }
}

Plan MakePlan(const AttentionParams& p) {
  Plan plan;
  plan.p = &p;
  plan.group_size = p.shape.group_size();
  plan.head_dim = p.shape.head_dim;
  plan.dim_padded = (p.shape.head_dim + kVecWidth - 1) / kVecWidth * kVecWidth;
  plan.tile_tokens = std::max(1, kTargetTileRows / plan.group_size);
  plan.q_scale = p.shape.softmax_scale * kLog2e;

  plan.slice_tile_offset.resize(p.num_slices);
  for (int64_t si = 0; si < p.num_slices; ++si) {
    const SequenceSlice& s = p.slices[si];
    plan.slice_tile_offset[si] = static_cast<int64_t>(plan.key_tiles.size());
    if (s.q_len == 0) continue;  // no item will read this slice's tiles
    for (int64_t k0 = 0; k0 < s.kv_len; k0 += kKeyTile) {
      const int64_t n = std::min<int64_t>(kKeyTile, s.kv_len - k0);
      KeyTileInfo info{std::numeric_limits<int32_t>::max(), -1, n == kKeyTile};
      for (int64_t j = 0; j < n; ++j) {
        const int32_t kp = p.k_pos[s.kv_begin + k0 + j];
        if (kp < 0) {
          info.all_valid = false;
        } else {
          info.min_pos = std::min(info.min_pos, kp);
          info.max_pos = std::max(info.max_pos, kp);
        }
      }
      plan.key_tiles.push_back(info);
    }
  }

  // Later query tiles of a causal chunk see more keys; listing them first lets the pool's
  // dynamic hand-out finish with the cheap items and balance better.
  for (int64_t si = 0; si < p.num_slices; ++si) {
    const SequenceSlice& s = p.slices[si];
    const int64_t num_q_tiles = (s.q_len + plan.tile_tokens - 1) / plan.tile_tokens;
    for (int64_t t = num_q_tiles - 1; t >= 0; --t) {
      const int64_t begin = s.q_begin + t * plan.tile_tokens;
      const int32_t n =
          static_cast<int32_t>(std::min<int64_t>(plan.tile_tokens, s.q_begin + s.q_len - begin));
      for (int h = 0; h < p.shape.num_kv_heads; ++h) {
        plan.items.push_back(WorkItem{si, begin, n, h});
      }
    }
  }
  return plan;
}

}  // namespace

absl::Status PartialAttentionCpu(const AttentionParams& p, ThreadPool* pool) {
  CPFILL_RETURN_IF_ERROR(ValidateAttentionParams(p));
  if (p.q_tokens == 0) return absl::OkStatus();

  // Rows covered by no slice get the empty-row convention; slices do not overlap (validated).
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (int64_t si = 0; si < p.num_slices; ++si) {
    if (p.slices[si].q_len > 0) {
      covered.emplace_back(p.slices[si].q_begin, p.slices[si].q_begin + p.slices[si].q_len);
    }
  }
  std::sort(covered.begin(), covered.end());
  int64_t next_row = 0;
  for (const auto& [begin, end] : covered) {
    if (begin > next_row) WriteEmptyRows(p, next_row, begin);
    next_row = end;
  }
  if (next_row < p.q_tokens) WriteEmptyRows(p, next_row, p.q_tokens);

  const Plan plan = MakePlan(p);
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  auto run = [&plan](int64_t i) { RunItem(plan, plan.items[i]); };
  if (pool != nullptr) {
    pool->ParallelFor(num_items, run);
  } else {
    for (int64_t i = 0; i < num_items; ++i) run(i);
  }
  return absl::OkStatus();
}

}  // namespace cpfill::attention
