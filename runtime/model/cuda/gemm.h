// cpfill/runtime/model/cuda/gemm.h — the model's linear layers on cuBLASLt: y = x W^T with bf16
// operands and fp32 accumulation, y in bf16 or fp32.
//
//   Gemm gemm;  CPFILL_RETURN_IF_ERROR(gemm.Init(stream));
//   CPFILL_RETURN_IF_ERROR(gemm.Linear(x, tokens, in, w, out, y_f32, OutType::kFloat32));
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "absl/status/status.h"
#include "runtime/model/cuda/cublaslt_library.h"

namespace cpfill::runtime::cuda {

enum class OutType { kBfloat16, kFloat32 };

class Gemm {
 public:
  Gemm() = default;
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Handle, a 32 MiB workspace; work runs on `stream`.
  absl::Status Init(cudaStream_t stream);

  // y [tokens, out] = x [tokens, in] * w^T; x and w bf16 row-major (w a Hugging Face Linear
  // weight [out, in]); y bf16 or fp32 by `out_type`. The best algorithm cuBLASLt's heuristic
  // offers is looked up once per shape; a decode step of one row takes SmallBatchLinear (gemv.h).
  absl::Status Linear(const __nv_bfloat16* x, int64_t tokens, int64_t in, const __nv_bfloat16* w,
                      int64_t out, void* y, OutType out_type);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const CublasLt* lt_ = nullptr;  // opened by Init
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, Plan> plans_;
};

}  // namespace cpfill::runtime::cuda
