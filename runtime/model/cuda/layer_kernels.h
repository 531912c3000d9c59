// cpfill/runtime/model/cuda/layer_kernels.h — the Llama layer's elementwise and row kernels on the
// GPU. The residual stream stays in fp32; GEMM inputs are bf16. Launchers take a stream, never
// synchronize, never allocate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace cpfill::runtime::cuda {

// x [T, D] fp32 = rows `ids` (device) of table [vocab, D] bf16.
absl::Status EmbedToF32(const int32_t* ids, int64_t tokens, const __nv_bfloat16* table,
                        int64_t hidden, float* x, cudaStream_t stream);

// y [T, D] bf16 = x / sqrt(mean(x^2) + eps) * weight; x fp32, weight bf16.
absl::Status RmsNormToBf16(const float* x, const __nv_bfloat16* weight, int64_t tokens,
                           int64_t hidden, float eps, __nv_bfloat16* y, cudaStream_t stream);

// Rotate-half RoPE in place on x [T, heads, head_dim] bf16 at `positions` (device, int32);
// inv_freq [head_dim / 2] (device, double): angles in double, one per token and frequency.
absl::Status RopeBf16(__nv_bfloat16* x, const int32_t* positions, int64_t tokens, int heads,
                      int head_dim, const double* inv_freq, cudaStream_t stream);

// out = silu(gate) * up, all bf16 (out may alias gate).
absl::Status SwiGluBf16(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n,
                        __nv_bfloat16* out, cudaStream_t stream);

// x += y, fp32.
absl::Status AddF32(float* x, const float* y, int64_t n, cudaStream_t stream);

// out = bf16(in).
absl::Status F32ToBf16(const float* in, int64_t n, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace cpfill::runtime::cuda
