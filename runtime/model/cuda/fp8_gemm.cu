#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/model/cuda/cublas_check.h"
#include "runtime/model/cuda/fp8_gemm.h"

namespace cpfill::runtime::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kQuantizeThreads = 256;
constexpr float kE4M3MaxF = 448.0f;
constexpr float kMinRowMaxF = 1e-12f;  // fp8.h's kFp8MinRowMax

struct QuantizeParams {
  const __nv_bfloat16* x;
  int64_t in;
  float scale_ub;
  uint8_t* xq;
  float* x_scale;
};

// One block per token: max |x| over the row, then every element divided (IEEE division, as the
// host's) and rounded to E4M3 with saturation.
__device__ void QuantizeRow(const QuantizeParams& p) {
  const __nv_bfloat16* row = p.x + blockIdx.x * p.in;
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < p.in; i += blockDim.x) {
    amax = fmaxf(amax, fabsf(__bfloat162float(row[i])));
  }
  __shared__ float partial[kQuantizeThreads / 32];
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < kQuantizeThreads / 32; ++w) amax = fmaxf(amax, partial[w]);
  if (p.scale_ub > 0) amax = fminf(amax, p.scale_ub);
  const float scale = fmaxf(amax, kMinRowMaxF) / kE4M3MaxF;
  if (threadIdx.x == 0) p.x_scale[blockIdx.x] = scale;
  uint8_t* out = p.xq + blockIdx.x * p.in;
  for (int64_t i = threadIdx.x; i < p.in; i += blockDim.x) {
    out[i] = __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(row[i]), scale), __NV_SATFINITE,
                                   __NV_E4M3);
  }
}

__global__ void __launch_bounds__(kQuantizeThreads)
    QuantizeRowsKernel(const __grid_constant__ QuantizeParams p) {
  QuantizeRow(p);
}

template <typename OutT>
__global__ void ScaleKernel(const float* acc, int64_t tokens, int64_t out, const float* x_scale,
                            const float* w_scale, OutT* y) {
  const int64_t n = tokens * out;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = acc[i] * (x_scale[i / out] * w_scale[i % out]);
    if constexpr (sizeof(OutT) == 4) {
      y[i] = v;
    } else {
      y[i] = __float2bfloat16(v);
    }
  }
}

}  // namespace

absl::Status QuantizeRowsFp8(const __nv_bfloat16* x, int64_t tokens, int64_t in, float scale_ub,
                             uint8_t* xq, float* x_scale, cudaStream_t stream) {
  CPFILL_CHECK_ARG(tokens >= 0 && in > 0 && tokens < (int64_t{1} << 31), "QuantizeRowsFp8: tokens ",
                   tokens, " in ", in);
  if (tokens == 0) return absl::OkStatus();
  const QuantizeParams p{x, in, scale_ub, xq, x_scale};
  QuantizeRowsKernel<<<static_cast<unsigned>(tokens), kQuantizeThreads, 0, stream>>>(p);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status ApplyRowColScales(const float* acc, int64_t tokens, int64_t out, const float* x_scale,
                               const float* w_scale, void* y, OutType out_type,
                               cudaStream_t stream) {
  const int64_t n = tokens * out;
  if (n == 0) return absl::OkStatus();
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1 << 20));
  if (out_type == OutType::kFloat32) {
    ScaleKernel<<<blocks, threads, 0, stream>>>(acc, tokens, out, x_scale, w_scale,
                                                static_cast<float*>(y));
  } else {
    ScaleKernel<<<blocks, threads, 0, stream>>>(acc, tokens, out, x_scale, w_scale,
                                                static_cast<__nv_bfloat16*>(y));
  }
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

const char* Fp8ScaleModeName(Fp8ScaleMode mode) {
  switch (mode) {
    case Fp8ScaleMode::kOuterVector:
      return "outer_vector";
    case Fp8ScaleMode::kEpilogue:
      return "epilogue";
    case Fp8ScaleMode::kPerTensor:
      return "per_tensor";
  }
  return "?";
}

Fp8Gemm::~Fp8Gemm() {
  for (auto& [key, p] : plans_) {
    lt_->MatrixLayoutDestroy(p.a);
    lt_->MatrixLayoutDestroy(p.b);
    lt_->MatrixLayoutDestroy(p.c);
    lt_->MatmulDescDestroy(p.desc);
  }
  cudaFree(workspace_);
  if (handle_) lt_->Destroy(handle_);
}

absl::Status Fp8Gemm::Init(cudaStream_t stream, bool fast_accum) {
  stream_ = stream;
  fast_accum_ = fast_accum;
  CPFILL_ASSIGN_OR_RETURN(lt_, OpenCublasLt());
  CPFILL_CUBLAS_CHECK(lt_->Create(&handle_));
  CPFILL_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  workspace_bytes_ = kWorkspaceBytes;
  return absl::OkStatus();
}

// Row-major y [T, out] = xq [T, in] wq^T is, column-major, y^T [out, T] = Wq x^T: A is wq
// ([in, out] column-major, transposed: the "TN" layout FP8 requires), B is xq. So A's outer
// vector has M = out elements (w_scale) and B's has N = T (x_scale).
absl::Status Fp8Gemm::MakePlan(const Fp8GemmArgs& g, cudaDataType_t c_type, Fp8ScaleMode mode,
                               Plan* p) {
  CPFILL_CUBLAS_CHECK(lt_->MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const auto& value) {
    return lt_->MatmulDescSetAttribute(p->desc, attr, &value, sizeof(value));
  };
  CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum_)));
  if (mode == Fp8ScaleMode::kOuterVector) {
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, outer));
    CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, outer));
  }
  if (mode != Fp8ScaleMode::kEpilogue) {
    // The scale pointers are part of the descriptor; Linear sets the call's own before each run.
    CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.w_scale));
    CPFILL_CUBLAS_CHECK(set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.x_scale));
  }
  CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, g.in, g.out, g.in));
  CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, g.in, g.tokens, g.in));
  CPFILL_CUBLAS_CHECK(lt_->MatrixLayoutCreate(&p->c, c_type, g.out, g.tokens, g.out));
  cublasLtMatmulPreference_t pref;
  CPFILL_CUBLAS_CHECK(lt_->MatmulPreferenceCreate(&pref));
  CPFILL_CUBLAS_CHECK(lt_->MatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = lt_->MatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c,
                                                        pref, 1, &result, &found);
  lt_->MatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    lt_->MatrixLayoutDestroy(p->a);
    lt_->MatrixLayoutDestroy(p->b);
    lt_->MatrixLayoutDestroy(p->c);
    lt_->MatmulDescDestroy(p->desc);
    return absl::InvalidArgumentError(absl::StrCat(
        "cuBLASLt offers no FP8 algorithm (", Fp8ScaleModeName(mode), " scales, status ",
        static_cast<int>(st), ") for ", g.tokens, "x", g.in, " * ", g.out, "x", g.in, "^T"));
  }
  p->algo = result.algo;
  return absl::OkStatus();
}

absl::Status Fp8Gemm::Linear(const Fp8GemmArgs& g, void* y, OutType out_type, Fp8ScaleMode mode,
                             float* acc) {
  if (g.tokens == 0 || g.out == 0) return absl::OkStatus();
  CPFILL_CHECK_ARG(g.in % 16 == 0, "Fp8Gemm: in = ", g.in, " is not a multiple of 16");
  CPFILL_CHECK_ARG(mode != Fp8ScaleMode::kEpilogue || acc != nullptr,
                   "Fp8Gemm: the epilogue mode needs an fp32 accumulator buffer");
  // The epilogue path's GEMM writes fp32 accumulators, whatever y's type.
  const OutType gemm_out = mode == Fp8ScaleMode::kEpilogue ? OutType::kFloat32 : out_type;
  const PlanKey key{g.tokens, g.in, g.out, static_cast<int>(gemm_out), static_cast<int>(mode)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan p;
    CPFILL_RETURN_IF_ERROR(
        MakePlan(g, gemm_out == OutType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF, mode, &p));
    it = plans_.emplace(key, p).first;
  }
  const Plan& p = it->second;
  if (mode != Fp8ScaleMode::kEpilogue) {
    CPFILL_CUBLAS_CHECK(lt_->MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &g.w_scale, sizeof(g.w_scale)));
    CPFILL_CUBLAS_CHECK(lt_->MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                    &g.x_scale, sizeof(g.x_scale)));
  }
  void* d = mode == Fp8ScaleMode::kEpilogue ? static_cast<void*>(acc) : y;
  const float alpha = 1.0f, beta = 0.0f;
  CPFILL_CUBLAS_CHECK(lt_->Matmul(handle_, p.desc, &alpha, g.wq, p.a, g.xq, p.b, &beta, d, p.c, d,
                                  p.c, &p.algo, workspace_, workspace_bytes_, stream_));
  if (mode != Fp8ScaleMode::kEpilogue) return absl::OkStatus();
  return ApplyRowColScales(acc, g.tokens, g.out, g.x_scale, g.w_scale, y, out_type, stream_);
}

Fp8ScaleMode Fp8Gemm::ModeFor(const Fp8GemmArgs& g, OutType out_type) {
  const PlanKey key{g.tokens, g.in, g.out, static_cast<int>(out_type),
                    static_cast<int>(Fp8ScaleMode::kOuterVector)};
  if (plans_.count(key) != 0) return Fp8ScaleMode::kOuterVector;
  if (no_outer_vector_.count(key) != 0) return Fp8ScaleMode::kEpilogue;
  Plan p;
  const cudaDataType_t c_type = out_type == OutType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
  if (MakePlan(g, c_type, Fp8ScaleMode::kOuterVector, &p).ok()) {
    plans_.emplace(key, p);
    return Fp8ScaleMode::kOuterVector;
  }
  no_outer_vector_.insert(key);
  return Fp8ScaleMode::kEpilogue;
}

}  // namespace cpfill::runtime::cuda
