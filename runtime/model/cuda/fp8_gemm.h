// cpfill/runtime/model/cuda/fp8_gemm.h — row-wise FP8 linear layers on Hopper (fp8.h defines the
// arithmetic): per-token E4M3 quantization of the activations, and y = (xq wq^T) * x_scale[t] *
// w_scale[o] through cuBLASLt.
//
// Scales on both sides, three ways (Fp8ScaleMode):
//   kOuterVector   cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F on A and B (cuBLAS >=
//                  12.9 on sm_90): the scales applied inside the GEMM's epilogue, one pass.
//   kEpilogue      cuBLASLt FP8 with unit scales writing fp32, then ApplyRowColScales: correct
//                  everywhere FP8 GEMMs run, at the cost of writing and re-reading [T, out] fp32.
//   kPerTensor     one scalar per operand (x_scale[0], w_scale[0]): the baseline cuBLASLt has
//                  offered since CUDA 12.0, for benchmarks; not row-wise.
//
//   Fp8Gemm gemm;  CPFILL_RETURN_IF_ERROR(gemm.Init(stream));
//   CPFILL_RETURN_IF_ERROR(QuantizeRowsFp8(x, T, in, 1200.f, xq, x_scale, stream));
//   CPFILL_RETURN_IF_ERROR(gemm.Linear({xq, x_scale, wq, w_scale, T, in, out}, y,
//   OutType::kBfloat16,
//                                      gemm.ModeFor(args, OutType::kBfloat16), acc_workspace));
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <set>
#include <tuple>

#include "absl/status/status.h"
#include "runtime/model/cuda/cublaslt_library.h"
#include "runtime/model/cuda/gemm.h"

namespace cpfill::runtime::cuda {

// x [tokens, in] bf16 -> xq [tokens, in] E4M3 codes, x_scale [tokens] fp32, exactly as
// QuantizeActivations (fp8.h) on the same values: scale = max(min(max|x|, ub), 1e-12) / 448,
// xq = RNE-saturating E4M3(x / scale). One block per token.
absl::Status QuantizeRowsFp8(const __nv_bfloat16* x, int64_t tokens, int64_t in, float scale_ub,
                             uint8_t* xq, float* x_scale, cudaStream_t stream);

// y [tokens, out] = acc * (x_scale[t] * w_scale[o]) in fp32, stored fp32 or bf16 (y may alias
// acc when fp32).
absl::Status ApplyRowColScales(const float* acc, int64_t tokens, int64_t out, const float* x_scale,
                               const float* w_scale, void* y, OutType out_type,
                               cudaStream_t stream);

enum class Fp8ScaleMode { kOuterVector, kEpilogue, kPerTensor };
const char* Fp8ScaleModeName(Fp8ScaleMode mode);

// One row-wise FP8 GEMM's operands, all device memory. xq [tokens, in], wq [out, in] row-major
// E4M3; x_scale [tokens], w_scale [out] fp32 (kPerTensor reads element 0 of each). cuBLASLt's
// FP8 kernels need in % 16 == 0 and 16-byte aligned pointers.
struct Fp8GemmArgs {
  const uint8_t* xq;
  const float* x_scale;
  const uint8_t* wq;
  const float* w_scale;
  int64_t tokens, in, out;
};

class Fp8Gemm {
 public:
  Fp8Gemm() = default;
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // Handle and a 32 MiB workspace; work runs on `stream`. `fast_accum`: Hopper's FP8 tensor
  // cores accumulate without the periodic fp32 promotion (fbgemm's use_fast_accum).
  absl::Status Init(cudaStream_t stream, bool fast_accum = false);

  // y [tokens, out] fp32 or bf16. kEpilogue needs `acc` [tokens, out] fp32 (may be y when y is
  // fp32); the other modes ignore it. InvalidArgument when cuBLASLt offers no algorithm for
  // the shape and mode (kOuterVector on cuBLASLt < 12.9 or before sm_90).
  absl::Status Linear(const Fp8GemmArgs& a, void* y, OutType out_type, Fp8ScaleMode mode,
                      float* acc);

  // kOuterVector where cuBLASLt offers an algorithm for this shape and output type (its plan is
  // then kept), else kEpilogue; the answer is remembered per shape.
  Fp8ScaleMode ModeFor(const Fp8GemmArgs& a, OutType out_type);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  absl::Status MakePlan(const Fp8GemmArgs& a, cudaDataType_t c_type, Fp8ScaleMode mode, Plan* p);

  const CublasLt* lt_ = nullptr;
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool fast_accum_ = false;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  // (tokens, in, out, output type, mode)
  using PlanKey = std::tuple<int64_t, int64_t, int64_t, int, int>;
  std::map<PlanKey, Plan> plans_;
  std::set<PlanKey> no_outer_vector_;  // shapes cuBLASLt has no outer-vector algorithm for
};

}  // namespace cpfill::runtime::cuda
