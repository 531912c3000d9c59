// cpfill/attention/cuda/mma_kernel.cuh — the mma.sync partial-attention kernel (sm_80+): what
// every GPU but Hopper runs, and Hopper too with CPFILL_ATTENTION_KERNEL=mma.
//
// FlashAttention-2's algorithm, written for cpfill's contract: fused varseq slices, per-token
// global positions, GQA folded into the M tile, three output modes. What it shares with the
// Hopper kernel (the launch layout, the key-tile pre-pass, the query-tile and key-tile walks,
// the epilogue) and the PTX wrappers it calls are in flash_common.cuh.
//
// One CTA = one (slice, kv head, query tile of kBlockM rows). Row r of a slice's M dimension is
// (token r / G, query head kv_head * G + r % G), G = group size: every K/V tile the CTA loads
// feeds the whole GQA group. kWarps warps each own kMTiles x 16 rows.
//
// Per CTA:
//   1. Q tile -> shared memory (cp.async, zero-filled past the slice); with one m-tile per warp
//      also -> registers (ldmatrix); the tile's min/max query position and padding.
//   2. For each key tile of kBlockN keys that the per-tile summary (a pre-pass) does not show
//      hidden: K, V and key positions arrive by cp.async into a double buffer while the previous
//      tile computes; S = Q K^T (mma.m16n8k16, K fragments by ldmatrix), the element mask only
//      on tiles the summary does not show fully visible, online softmax in base 2 (running max
//      m of the raw scores and partial sum l per row; the scale rides in the exponent's FMA),
//      O = alpha O + P V (P re-packed from the S accumulators, V fragments by ldmatrix.trans).
//   3. Epilogue: l reduced across the quad, O / l and LSE = (m + log2 l) ln 2 written, or merged
//      into the running fp32 (O, LSE).
//
// Shared memory rows of head_dim bf16 are split in 16-byte chunks stored at chunk ^ (row & 7),
// so the 8 rows one ldmatrix phase reads fall in 8 different bank groups.
//
// attention_cuda.cu picks the shape (its variants) and launches it after PrepareLaunch and the
// pre-pass (flash_common.cuh), one CTA per (query tile, kv head):
//
//   using Cfg = FlashConfig<128, 64, 4, 2>;  // head_dim, keys a tile, warps, m16 tiles a warp
//   auto kernel = FlashForwardKernel<128, 64, 4, 2, /*kMinBlocks=*/2>;
//   cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
//   kernel<<<dim3(extent.q_tiles, num_kv_heads), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention/cuda/flash_common.cuh"

namespace cpfill::attention::cuda::internal {

// The kernel's parameters: the common fields (flash_common.cuh), the call's K and V (bf16 rows of
// num_kv_heads * head_dim, a slice's keys from its kv_begin on) and the slice table.
struct FlashParams : LaunchCommon {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  SliceDesc slices[kMaxSlicesPerLaunch];
};
static_assert(sizeof(FlashParams) <= 4096, "kernel parameters must fit the 4 KiB limit");

// kMTiles m16 tiles per warp: with 2, every K or V fragment loaded from shared memory feeds
// twice the MMAs (FlashAttention-2's 32 rows per warp); Q then stays in shared memory and is
// re-read per k step, which keeps the register count under 255.
template <int kDim, int kBlockN, int kWarps, int kMTiles>
struct FlashConfig {
  static_assert(kDim % 16 == 0 && kBlockN % 16 == 0, "tiles must be multiples of 16");
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kChunks = kDim / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = kBlockM * kDim * 2;
  static constexpr int kKvTileBytes = kBlockN * kDim * 2;
  static constexpr int kPosBytes = kBlockN * 4;
  // Q | K[2] | V[2] | key positions[2]
  static constexpr int kSmemBytes = kQBytes + 4 * kKvTileBytes + 2 * kPosBytes;
  static constexpr bool kQInRegisters = kMTiles == 1;
};

template <int kDim, int kBlockN, int kWarps, int kMTiles, int kMinBlocks>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks)
    FlashForwardKernel(const __grid_constant__ FlashParams p) {
  using Cfg = FlashConfig<kDim, kBlockN, kWarps, kMTiles>;
  constexpr int kBlockM = Cfg::kBlockM;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* s_q = smem;
  unsigned char* s_k = s_q + Cfg::kQBytes;
  unsigned char* s_v = s_k + 2 * Cfg::kKvTileBytes;
  int32_t* s_kpos = reinterpret_cast<int32_t*>(s_v + 2 * Cfg::kKvTileBytes);
  __shared__ int32_t s_qstat[kWarps][3];

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int group_id = lane >> 2, tig = lane & 3;

  const QueryTile tile =
      LocateQueryTile(p.slices, p.num_slices, p.group, kBlockM, static_cast<int>(blockIdx.x));
  const SliceDesc sl = tile.slice;
  const int m_block = tile.m_block;
  const int G = p.group;
  const int64_t slice_rows = sl.q_len * G;
  const int kv_head = blockIdx.y;
  const int64_t q_stride = static_cast<int64_t>(p.num_heads) * kDim;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * kDim;
  const int64_t row0 = static_cast<int64_t>(m_block) * kBlockM;
  // What the epilogue needs about the slice, parked in shared memory across the key loop.
  __shared__ int64_t s_epilogue[3];
  if (tid == 0) {
    s_epilogue[0] = sl.o_begin;
    s_epilogue[1] = slice_rows;
    s_epilogue[2] = row0;
  }
  // Row (within the tile) of m-tile mt of this warp, and of this thread's two rows in it.
  auto tile_row = [&](int mt) { return (warp * kMTiles + mt) * 16; };

  // Step 1: the Q tile, by cp.async; rows past the slice are zero-filled.
  for (int i = tid; i < kBlockM * Cfg::kChunks; i += Cfg::kThreads) {
    const int r = i / Cfg::kChunks, c = i % Cfg::kChunks;
    const int64_t row = row0 + r;
    const bool in = row < slice_rows;
    const int64_t t = in ? row / G : 0;
    const int g = in ? static_cast<int>(row % G) : 0;
    const __nv_bfloat16* src =
        p.q + (sl.q_begin + t) * q_stride + static_cast<int64_t>(kv_head * G + g) * kDim + c * 8;
    CpAsync16(SmemAddr(s_q + SwizzledOffset<kDim>(r, c)), in ? src : p.q, in ? 16 : 0);
  }
  CpAsyncCommit();

  // Query positions of the tile's rows (-1 for padding or past the slice), in shared memory:
  // only masked tiles read them, and registers are the scarce resource. Then the tile's
  // statistics: min/max valid position, and whether an in-slice row is padding.
  __shared__ int32_t s_qpos[kBlockM];
  for (int r = tid; r < kBlockM; r += Cfg::kThreads) {
    const int64_t row = row0 + r;
    s_qpos[r] = row < slice_rows ? p.q_pos[sl.q_begin + row / G] : -1;
  }
  {
    int32_t mn = INT32_MAX, mx = -1, pad = 0;
    for (int r = lane; r < kBlockM; r += 32) {
      if (r / (16 * kMTiles) != warp) continue;  // each warp summarises its own rows
      const int64_t row = row0 + r;
      if (row >= slice_rows) continue;
      const int32_t pos = p.q_pos[sl.q_begin + row / G];
      if (pos < 0) {
        pad = 1;
      } else {
        mn = min(mn, pos);
        mx = max(mx, pos);
      }
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    pad = __reduce_or_sync(0xffffffffu, pad);
    if (lane == 0) {
      s_qstat[warp][0] = mn;
      s_qstat[warp][1] = mx;
      s_qstat[warp][2] = pad;
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  int32_t q_min = INT32_MAX, q_max = -1, q_pad = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    q_min = min(q_min, s_qstat[w][0]);
    q_max = max(q_max, s_qstat[w][1]);
    q_pad |= s_qstat[w][2];
  }

  // Q fragments: kept in registers when a warp owns one m-tile, else re-read per k step.
  // Rows tile_row(mt) + q_row, chunk 2 kk + q_half: as for K below, the swizzle is one XOR.
  const uint32_t q_addr =
      SmemAddr(s_q) + ((warp * kMTiles) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kDim * 2;
  const uint32_t q_swz = static_cast<uint32_t>(((lane >> 4) ^ (lane & 7)) * 16);
  auto load_q_frag = [&](uint32_t(&frag)[4], int mt, int kk) {
    // Volatile: left to itself the compiler precomputes this address for every (mt, kk) and
    // spills them (the accumulators take almost every register); one XOR per use is cheaper.
    uint32_t swz;
    asm volatile("xor.b32 %0, %1, %2;\n" : "=r"(swz) : "r"(q_swz), "r"(kk << 5));
    LdMatrixX4(frag, q_addr + mt * 16 * kDim * 2 + swz);
  };
  uint32_t q_regs[Cfg::kQInRegisters ? kDim / 16 : 1][4];
  if constexpr (Cfg::kQInRegisters) {
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) load_q_frag(q_regs[kk], 0, kk);
  }

  float o_acc[kMTiles][kDim / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < kDim / 8; ++i) {
      o_acc[mt][i][0] = o_acc[mt][i][1] = o_acc[mt][i][2] = o_acc[mt][i][3] = 0.f;
    }
  }
  float m_row[kMTiles][2], l_row[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    m_row[mt][0] = m_row[mt][1] = -INFINITY;
    l_row[mt][0] = l_row[mt][1] = 0.f;
  }

  const int num_k_tiles = static_cast<int>((sl.kv_len + kBlockN - 1) / kBlockN);
  const VisibleKeyTiles tiles{
      p.key_tiles + sl.k_tile_start, num_k_tiles, q_min, q_max, q_pad, p.causal};
  auto classify = [&](int j) { return tiles.Classify(j); };
  auto next_visible = [&](int j) { return tiles.NextVisible(j); };
  // K/V rows of this slice and head start here; a thread always copies the same 16-byte chunk
  // column of every row it touches, so its offsets advance by constants.
  const __nv_bfloat16* k_base = p.k + sl.kv_begin * kv_stride + kv_head * kDim;
  const __nv_bfloat16* v_base = p.v + sl.kv_begin * kv_stride + kv_head * kDim;
  const int32_t* kpos_base = p.k_pos + sl.kv_begin;
  const int kv_len = static_cast<int>(sl.kv_len);  // < 2^31 (positions are int32)
  constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunks;
  static_assert(Cfg::kThreads % Cfg::kChunks == 0 && kBlockN % kRowsPerPass == 0,
                "the tile loader covers whole rows");
  const int ld_chunk = tid % Cfg::kChunks, ld_row = tid / Cfg::kChunks;
  auto load_tile = [&](int j, int buf) {
    const int key0 = j * kBlockN;
    unsigned char* dk = s_k + buf * Cfg::kKvTileBytes;
    unsigned char* dv = s_v + buf * Cfg::kKvTileBytes;
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int r = ld_row + i * kRowsPerPass;
      const bool in = key0 + r < kv_len;
      const int64_t off = static_cast<int64_t>(key0 + r) * kv_stride + ld_chunk * 8;
      const uint32_t so = SwizzledOffset<kDim>(r, ld_chunk);
      CpAsync16(SmemAddr(dk + so), in ? k_base + off : p.k, in ? 16 : 0);
      CpAsync16(SmemAddr(dv + so), in ? v_base + off : p.v, in ? 16 : 0);
    }
    for (int i = tid; i < kBlockN; i += Cfg::kThreads) {
      const bool in = key0 + i < kv_len;
      CpAsync4(SmemAddr(s_kpos + buf * kBlockN + i), in ? kpos_base + key0 + i : p.k_pos,
               in ? 4 : 0);
    }
  };

  // Per-thread ldmatrix geometry (see SwizzledOffset): K fragments read rows k_row + 16 nn,
  // chunk 2 kk + k_half; V fragments rows v_row + 16 kk, chunk 2 dd + v_half. Rows differ from
  // k_row / v_row by multiples of 8, so row & 7 = lane & 7 and the swizzle is one XOR.
  const int k_row = (lane & 7) + (lane >> 4) * 8, k_half = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_half = lane >> 4;
  const uint32_t k_swz = static_cast<uint32_t>((k_half ^ (lane & 7)) * 16);
  const uint32_t v_swz = static_cast<uint32_t>((v_half ^ (lane & 7)) * 16);

  int j = next_visible(0);
  int buf = 0;
  if (j < num_k_tiles) load_tile(j, 0);
  CpAsyncCommit();
  while (j < num_k_tiles) {
    const int mode = classify(j);
    const int j_next = next_visible(j + 1);
    // Step 2.1: the next visible tile streams in while this one computes.
    if (j_next < num_k_tiles) load_tile(j_next, buf ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();

    const uint32_t tk_addr = SmemAddr(s_k + buf * Cfg::kKvTileBytes) + k_row * kDim * 2;
    const uint32_t tv_addr = SmemAddr(s_v + buf * Cfg::kKvTileBytes) + v_row * kDim * 2;
    const int32_t* tpos = s_kpos + buf * kBlockN;

    // Step 2.2: S = Q K^T for this warp's rows x kBlockN keys; each K fragment feeds every
    // m-tile of the warp.
    float s_acc[kMTiles][kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < kBlockN / 8; ++i) {
        s_acc[mt][i][0] = s_acc[mt][i][1] = s_acc[mt][i][2] = s_acc[mt][i][3] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      uint32_t qf[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (Cfg::kQInRegisters) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qf[mt][e] = q_regs[kk][e];
        } else {
          load_q_frag(qf[mt], mt, kk);
        }
      }
#pragma unroll
      for (int nn = 0; nn < kBlockN / 16; ++nn) {
        uint32_t b[4];
        // Row nn*16 + k_row, chunk (2 kk + k_half) ^ (row & 7): the XOR only touches the chunk
        // bits, so the address is k_frag_base(nn) ^ (kk << 5) with a per-thread constant.
        LdMatrixX4(b, tk_addr + nn * 16 * kDim * 2 + (k_swz ^ (kk << 5)));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma16816(s_acc[mt][2 * nn], qf[mt], b[0], b[1]);
          Mma16816(s_acc[mt][2 * nn + 1], qf[mt], b[2], b[3]);
        }
      }
    }

    // Step 2.3: the element mask where the tile is only partly visible.
    const int key0 = j * kBlockN;
    if (mode == 1) {
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + tig * 2 + (e & 1);
          const int32_t kp = tpos[c];
          const bool key_ok = key0 + c < kv_len && kp >= 0;
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            const int32_t qp = s_qpos[tile_row(mt) + group_id + (e >> 1) * 8];
            if (!(key_ok && qp >= 0 && (!p.causal || kp <= qp))) s_acc[mt][nt][e] = -INFINITY;
          }
        }
      }
    }

    // Step 2.4: online softmax per row (two rows per m-tile; a quad shares a row). The running
    // max m is kept on the raw scores; the scale into base 2 rides in the exponent's FMA.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m_row[mt][h];
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          mx = fmaxf(mx, fmaxf(s_acc[mt][nt][2 * h], s_acc[mt][nt][2 * h + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen no key yet keeps m = -inf; subtracting 0 then keeps p = 0.
        const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        // m_row = -inf -> alpha = 0 (the accumulator is 0 anyway).
        const float alpha = FastExp2(m_row[mt][h] * p.scale_log2 - m_scaled);
        m_row[mt][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          float& a = s_acc[mt][nt][2 * h];
          float& b = s_acc[mt][nt][2 * h + 1];
          a = FastExp2(fmaf(a, p.scale_log2, -m_scaled));
          b = FastExp2(fmaf(b, p.scale_log2, -m_scaled));
          sum += a + b;
        }
        l_row[mt][h] = l_row[mt][h] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kDim / 8; ++dt) {
          o_acc[mt][dt][2 * h] *= alpha;
          o_acc[mt][dt][2 * h + 1] *= alpha;
        }
      }
    }

    // Step 2.5: O += P V, P re-packed from the S accumulators as bf16 A fragments; each V
    // fragment (ldmatrix.trans) feeds every m-tile of the warp.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = PackBf16(s_acc[mt][2 * kk][0], s_acc[mt][2 * kk][1]);
        a[mt][1] = PackBf16(s_acc[mt][2 * kk][2], s_acc[mt][2 * kk][3]);
        a[mt][2] = PackBf16(s_acc[mt][2 * kk + 1][0], s_acc[mt][2 * kk + 1][1]);
        a[mt][3] = PackBf16(s_acc[mt][2 * kk + 1][2], s_acc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < kDim / 16; ++dd) {
        uint32_t b[4];
        LdMatrixX4Trans(b, tv_addr + kk * 16 * kDim * 2 + (v_swz ^ (dd << 5)));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma16816(o_acc[mt][2 * dd], a[mt], b[0], b[1]);
          Mma16816(o_acc[mt][2 * dd + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // this buffer is refilled by the next iteration's prefetch
    j = j_next;
    buf ^= 1;
  }

  // Step 3: epilogue, one m16 tile at a time.
  const EpilogueTarget target{p.o, p.lse, p.num_heads, p.group, p.out_mode, p.scale_log2};
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    StoreRows16<kDim>(target, blockIdx.y, s_epilogue[0], s_epilogue[1],
                      s_epilogue[2] + tile_row(mt), o_acc[mt], m_row[mt], l_row[mt], lane);
  }
}

}  // namespace cpfill::attention::cuda::internal
