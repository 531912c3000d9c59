// cpfill/runtime/model/cuda/gemv.h — the linear layers of decode steps: y = x W^T for a few token
// rows, a memory-bound pass over W.
//
// A decode step multiplies one row per sequence by every weight matrix, so its GEMMs read each
// weight byte once and do two FLOPs per byte: their time is the weights' bytes over the memory
// bandwidth. cuBLASLt's choice for such shapes ran the 8B model's 16 GB of weights at 2.0 TB/s on
// an H100 whose copy bandwidth is 3.0 TB/s (bench/results/2026-11-23-h100-decode-tpot). This
// kernel gives each warp one output feature and streams its weight row with 16-byte loads, four
// in flight per lane, against every token row at once (x is small and stays in L1/L2), then one
// warp reduction per token.
//
//   if (SmallBatchLinearApplies(tokens, in, x, w, y))
//     CPFILL_RETURN_IF_ERROR(SmallBatchLinear(x, tokens, in, w, out, y, /*y_f32=*/true, stream));
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace cpfill::runtime::cuda {

// Token rows up to which SmallBatchLinear runs (beyond, the weights are reread per row group and
// a tiled GEMM wins).
inline constexpr int kSmallBatchMaxTokens = 8;

// Token rows up to which the model's Gemm takes it: one. On an H200 (2026-11-28,
// bench/decode_linear_cuda_bench) an 8B layer's GEMMs took 137 us here and 141 on cuBLASLt at one
// row, but 150 against 141 at two rows and 290 against 142 at eight (each row adds a pass of
// conversions and FMAs per weight chunk, and the kernel turns compute-bound); on an H100 at one
// row it was 25% faster than cuBLASLt's choice (2026-11-24).
inline constexpr int kSmallBatchRouteTokens = 1;

// True when CPFILL_DECODE_GEMV is on, 1 <= tokens <= kSmallBatchMaxTokens, `in` is a multiple of
// 8 and x, w, y are 16-byte aligned.
bool SmallBatchLinearApplies(int64_t tokens, int64_t in, const void* x, const void* w,
                             const void* y);

// y [tokens, out] = x [tokens, in] * w^T (w [out, in], a Hugging Face Linear weight), bf16
// operands, fp32 accumulation, y fp32 (y_f32) or bf16. InvalidArgument unless it applies.
absl::Status SmallBatchLinear(const __nv_bfloat16* x, int64_t tokens, int64_t in,
                              const __nv_bfloat16* w, int64_t out, void* y, bool y_f32,
                              cudaStream_t stream);

}  // namespace cpfill::runtime::cuda
