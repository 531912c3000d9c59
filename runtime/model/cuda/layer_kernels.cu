#include <cuda_runtime.h>

#include <algorithm>

#include "base/status.h"
#include "runtime/model/cuda/layer_kernels.h"

namespace cpfill::runtime::cuda {
namespace {

int Blocks(int64_t n, int threads) {
  return static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1 << 20));
}

// Grid-stride loops: every launcher's element count fits any grid.
__global__ void EmbedKernel(const int32_t* ids, int64_t tokens, const __nv_bfloat16* table,
                            int64_t hidden, float* x) {
  const int64_t n = tokens * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __bfloat162float(table[int64_t{ids[i / hidden]} * hidden + i % hidden]);
  }
}

// One block per row: sum of squares in fp32 over the block, then the scaled row.
__global__ void RmsNormKernel(const float* x, const __nv_bfloat16* weight, int64_t hidden,
                              float eps, __nv_bfloat16* y) {
  const float* row = x + blockIdx.x * hidden;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) sum += row[i] * row[i];
  __shared__ float partial[32];
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / hidden + eps);
  }
  __syncthreads();
  const float scale = partial[0];
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    y[blockIdx.x * hidden + i] = __float2bfloat16(__bfloat162float(weight[i]) * (row[i] * scale));
  }
}

// One thread per (token, frequency): the angle in double, applied to every head.
__global__ void RopeKernel(__nv_bfloat16* x, const int32_t* positions, int64_t tokens, int heads,
                           int head_dim, const double* inv_freq) {
  const int half = head_dim / 2;
  const int64_t n = tokens * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / half;
    const int f = static_cast<int>(i % half);
    double s, c;
    sincos(positions[t] * inv_freq[f], &s, &c);
    const float cf = static_cast<float>(c), sf = static_cast<float>(s);
    for (int h = 0; h < heads; ++h) {
      __nv_bfloat16* v = x + (t * heads + h) * head_dim;
      const float x1 = __bfloat162float(v[f]), x2 = __bfloat162float(v[f + half]);
      v[f] = __float2bfloat16(x1 * cf - x2 * sf);
      v[f + half] = __float2bfloat16(x2 * cf + x1 * sf);
    }
  }
}

__global__ void SwiGluKernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n,
                             __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = __bfloat162float(gate[i]);
    out[i] = __float2bfloat16(g / (1.f + __expf(-g)) * __bfloat162float(up[i]));
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void ToBf16Kernel(const float* in, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16(in[i]);
  }
}

}  // namespace

absl::Status EmbedToF32(const int32_t* ids, int64_t tokens, const __nv_bfloat16* table,
                        int64_t hidden, float* x, cudaStream_t stream) {
  if (tokens == 0) return absl::OkStatus();
  EmbedKernel<<<Blocks(tokens * hidden, 256), 256, 0, stream>>>(ids, tokens, table, hidden, x);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status RmsNormToBf16(const float* x, const __nv_bfloat16* weight, int64_t tokens,
                           int64_t hidden, float eps, __nv_bfloat16* y, cudaStream_t stream) {
  if (tokens == 0) return absl::OkStatus();
  CPFILL_CHECK_ARG(tokens < (int64_t{1} << 31), "RmsNorm: too many rows for one launch");
  RmsNormKernel<<<static_cast<int>(tokens), 256, 0, stream>>>(x, weight, hidden, eps, y);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status RopeBf16(__nv_bfloat16* x, const int32_t* positions, int64_t tokens, int heads,
                      int head_dim, const double* inv_freq, cudaStream_t stream) {
  if (tokens == 0) return absl::OkStatus();
  CPFILL_CHECK_ARG(head_dim % 2 == 0, "RoPE needs an even head_dim, got ", head_dim);
  RopeKernel<<<Blocks(tokens * head_dim / 2, 256), 256, 0, stream>>>(x, positions, tokens, heads,
                                                                     head_dim, inv_freq);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status SwiGluBf16(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n,
                        __nv_bfloat16* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  SwiGluKernel<<<Blocks(n, 256), 256, 0, stream>>>(gate, up, n, out);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status AddF32(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<Blocks(n, 256), 256, 0, stream>>>(x, y, n);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status F32ToBf16(const float* in, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  ToBf16Kernel<<<Blocks(n, 256), 256, 0, stream>>>(in, n, out);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace cpfill::runtime::cuda
