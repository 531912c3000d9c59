// The small-batch linear kernel (gemv.h): one warp per output feature.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/knobs.h"
#include "base/status.h"
#include "runtime/model/cuda/gemv.h"

namespace cpfill::runtime::cuda {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kWarps = 8;  // output features per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane

// Eight bf16 products of one 16-byte chunk of w and of x, summed in fp32.
__device__ __forceinline__ float Dot8(const uint4& w, const uint4& x) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv[i]));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv[i]));
    sum = fmaf(a.x, b.x, sum);
    sum = fmaf(a.y, b.y, sum);
  }
  return sum;
}

// Lane l takes the 16-byte chunks l, l + 32, ... of its warp's weight row; kUnroll of them are
// loaded before any is used. Weights are read once per step: streamed past L1 (__ldcs); x is
// read by every warp: through the read-only cache (__ldg).
template <int kTokens, bool kF32Out>
__global__ void __launch_bounds__(kThreads)
    SmallBatchLinearKernel(const Bf16* __restrict__ x, int64_t in, const Bf16* __restrict__ w,
                           int64_t out, void* __restrict__ y) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (row >= out) return;
  const uint4* w_row = reinterpret_cast<const uint4*>(w + row * in);
  const uint4* x_rows = reinterpret_cast<const uint4*>(x);
  const int64_t chunks = in / 8;
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;

  int64_t c = lane;
  for (; c + 32 * (kUnroll - 1) < chunks; c += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = __ldcs(w_row + c + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int t = 0; t < kTokens; ++t)
        acc[t] += Dot8(wv[u], __ldg(x_rows + t * chunks + c + 32 * u));
    }
  }
  for (; c < chunks; c += 32) {
    const uint4 wv = __ldcs(w_row + c);
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[t] += Dot8(wv, __ldg(x_rows + t * chunks + c));
  }

#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], d);
  }
  if (lane != 0) return;
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if constexpr (kF32Out) {
      static_cast<float*>(y)[t * out + row] = acc[t];
    } else {
      static_cast<Bf16*>(y)[t * out + row] = __float2bfloat16(acc[t]);
    }
  }
}

template <int kTokens>
void Launch(const Bf16* x, int64_t in, const Bf16* w, int64_t out, void* y, bool y_f32,
            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((out + kWarps - 1) / kWarps));
  if (y_f32) {
    SmallBatchLinearKernel<kTokens, true><<<grid, kThreads, 0, stream>>>(x, in, w, out, y);
  } else {
    SmallBatchLinearKernel<kTokens, false><<<grid, kThreads, 0, stream>>>(x, in, w, out, y);
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool SmallBatchLinearApplies(int64_t tokens, int64_t in, const void* x, const void* w,
                             const void* y) {
  static const bool enabled = knobs::Bool(knobs::kDecodeGemv);
  return enabled && tokens >= 1 && tokens <= kSmallBatchMaxTokens && in > 0 && in % 8 == 0 &&
         Aligned16(x) && Aligned16(w) && Aligned16(y);
}

absl::Status SmallBatchLinear(const Bf16* x, int64_t tokens, int64_t in, const Bf16* w, int64_t out,
                              void* y, bool y_f32, cudaStream_t stream) {
  CPFILL_CHECK_ARG(SmallBatchLinearApplies(tokens, in, x, w, y) && out > 0 &&
                       (out + kWarps - 1) / kWarps < (int64_t{1} << 31),
                   "small-batch linear: ", tokens, " x ", in, " times ", out, " x ", in,
                   "^T does not apply (1 to ", kSmallBatchMaxTokens,
                   " rows, in a multiple of 8, 16-byte aligned, CPFILL_DECODE_GEMV on)");
  switch (tokens) {
    case 1:
      Launch<1>(x, in, w, out, y, y_f32, stream);
      break;
    case 2:
      Launch<2>(x, in, w, out, y, y_f32, stream);
      break;
    case 3:
      Launch<3>(x, in, w, out, y, y_f32, stream);
      break;
    case 4:
      Launch<4>(x, in, w, out, y, y_f32, stream);
      break;
    case 5:
      Launch<5>(x, in, w, out, y, y_f32, stream);
      break;
    case 6:
      Launch<6>(x, in, w, out, y, y_f32, stream);
      break;
    case 7:
      Launch<7>(x, in, w, out, y, y_f32, stream);
      break;
    default:
      Launch<8>(x, in, w, out, y, y_f32, stream);
      break;
  }
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace cpfill::runtime::cuda
