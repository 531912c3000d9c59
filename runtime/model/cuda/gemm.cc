#include "runtime/model/cuda/gemm.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/cuda/cublas_check.h"
#include "runtime/model/cuda/gemv.h"

namespace cpfill::runtime::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

}  // namespace

Gemm::~Gemm() {
  for (auto& [key, p] : plans_) {
    lt_->MatrixLayoutDestroy(p.a);
    lt_->MatrixLayoutDestroy(p.b);
    lt_->MatrixLayoutDestroy(p.c);
    lt_->MatmulDescDestroy(p.desc);
  }
  cudaFree(workspace_);
  if (handle_) lt_->Destroy(handle_);
}

absl::Status Gemm::Init(cudaStream_t stream) {
  stream_ = stream;
  CPFILL_ASSIGN_OR_RETURN(lt_, OpenCublasLt());
  CPFILL_CUBLAS_CHECK(lt_->Create(&handle_));
  CPFILL_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  workspace_bytes_ = kWorkspaceBytes;
  return absl::OkStatus();
}

absl::Status Gemm::Linear(const __nv_bfloat16* x, int64_t tokens, int64_t in,
                          const __nv_bfloat16* w, int64_t out, void* y, OutType out_type) {
  if (tokens == 0 || out == 0) return absl::OkStatus();
  if (tokens <= kSmallBatchRouteTokens && SmallBatchLinearApplies(tokens, in, x, w, y)) {
    return SmallBatchLinear(x, tokens, in, w, out, y, out_type == OutType::kFloat32, stream_);
  }
  // Row-major y [T, out] = x [T, in] w^T is, column-major, y^T [out, T] = W [out, in] x^T: A is
  // w stored [in, out] column-major, transposed; B is x stored [in, T] column-major.
  const auto key = std::make_tuple(tokens, in, out, static_cast<int>(out_type));
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan p;
    const cudaDataType_t c_type = out_type == OutType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
    CPFILL_CUBLAS_CHECK(lt_->MatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    CPFILL_CUBLAS_CHECK(
        lt_->MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
    CPFILL_CUBLAS_CHECK(
        lt_->MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
    CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p.a, CUDA_R_16BF, in, out, in));
    CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p.b, CUDA_R_16BF, in, tokens, in));
    CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p.c, c_type, out, tokens, out));
    cublasLtMatmulPreference_t pref;
    CPFILL_CUBLAS_CHECK(lt_->MatmulPreferenceCreate(&pref));
    CPFILL_CUBLAS_CHECK(
        lt_->MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                          &workspace_bytes_, sizeof(workspace_bytes_)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st =
        lt_->MatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
    lt_->MatmulPreferenceDestroy(pref);
    CPFILL_CUBLAS_CHECK(st);
    if (found == 0) {
      return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for ", tokens, "x", in,
                                              " * ", out, "x", in, "^T"));
    }
    p.algo = result.algo;
    it = plans_.emplace(key, p).first;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const Plan& p = it->second;
  CPFILL_CUBLAS_CHECK(lt_->Matmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                  &p.algo, workspace_, workspace_bytes_, stream_));
  return absl::OkStatus();
}

}  // namespace cpfill::runtime::cuda
