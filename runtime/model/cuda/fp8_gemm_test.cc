// GPU tests of the row-wise FP8 path (fp8_gemm.h): the activation quantizer against the host's
// (fp8.h) code for code, and the GEMM in each scale mode against an fp64 evaluation of the same
// codes, outputs poisoned with NaN first. Skips without a GPU.
#include "runtime/model/cuda/fp8_gemm.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/model/cuda/device_test_util.h"
#include "runtime/model/fp8.h"

namespace cpfill::runtime::cuda {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

using Bf16 = __nv_bfloat16;

class Fp8GemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device visible: the FP8 GEMM tests need a GPU host";
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    if (prop.major < 9 && !(prop.major == 8 && prop.minor == 9)) {
      GTEST_SKIP() << "no CUDA device visible with FP8 tensor cores (sm_89 or sm_90+)";
    }
  }
};

struct Case {
  std::vector<float> x;  // bf16-representable values
  std::vector<Bf16> x_bf16;
  Fp8Matrix w;
};

Case MakeCase(int64_t tokens, int64_t in, int64_t out, uint64_t seed) {
  Case c;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  c.x.resize(tokens * in);
  c.x_bf16.resize(tokens * in);
  for (int64_t i = 0; i < tokens * in; ++i) {
    c.x_bf16[i] = __float2bfloat16(n(rng) * (i % 977 == 0 ? 3000.f : 2.f));  // some past the ub
    c.x[i] = __bfloat162float(c.x_bf16[i]);
  }
  std::vector<float> w(out * in);
  for (float& v : w) v = n(rng) * 0.02f;
  c.w = QuantizeRowwise(w.data(), out, in);
  return c;
}

TEST_F(Fp8GemmTest, QuantizerMatchesHostCodeForCode) {
  const int64_t tokens = 37, in = 1000;
  const Case c = MakeCase(tokens, in, 16, 1);
  std::vector<uint8_t> want_q(tokens * in);
  std::vector<float> want_s(tokens);
  QuantizeActivations(c.x.data(), tokens, in, 1200.f, want_q.data(), want_s.data());
  const DevicePtr<Bf16> dx = ToDevice(c.x_bf16);
  const DevicePtr<uint8_t> dq = ToDevice(std::vector<uint8_t>(tokens * in, 0x7f));
  const DevicePtr<float> ds = ToDevice(std::vector<float>(tokens, std::nanf("")));
  ASSERT_TRUE(dx && dq && ds);
  ASSERT_TRUE(QuantizeRowsFp8(dx.get(), tokens, in, 1200.f, dq.get(), ds.get(), nullptr).ok());
  std::vector<uint8_t> got_q(tokens * in);
  std::vector<float> got_s(tokens);
  ASSERT_CUDA(cudaMemcpy(got_q.data(), dq.get(), got_q.size(), cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(got_s.data(), ds.get(), got_s.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got_s, want_s);
  EXPECT_EQ(got_q, want_q);
}

// Every mode the device offers, fp32 and bf16 outputs, against fp64 on the same codes: the bound
// is fp32 summation (in any order) of |products| plus, for bf16, the output's rounding.
void CheckGemm(Fp8Gemm& gemm, Fp8ScaleMode mode, bool y_f32, int64_t tokens, int64_t in,
               int64_t out) {
  const std::string what = absl::StrCat(Fp8ScaleModeName(mode), " ", tokens, "x", in, "->", out,
                                        y_f32 ? " fp32" : " bf16");
  const Case c = MakeCase(tokens, in, out, tokens * 31 + out);
  std::vector<uint8_t> xq(tokens * in);
  std::vector<float> xs(tokens);
  QuantizeActivations(c.x.data(), tokens, in, 1200.f, xq.data(), xs.data());
  const DevicePtr<uint8_t> dxq = ToDevice(xq), dwq = ToDevice(c.w.codes);
  const DevicePtr<float> dxs = ToDevice(xs), dws = ToDevice(c.w.row_scale);
  const DevicePtr<uint8_t> dy = ToDevice(std::vector<uint8_t>(tokens * out * 4, 0xff));
  const DevicePtr<float> dacc = ToDevice(std::vector<float>(tokens * out, std::nanf("")));
  ASSERT_TRUE(dxq && dwq && dxs && dws && dy && dacc) << what;
  const absl::Status s =
      gemm.Linear({dxq.get(), dxs.get(), dwq.get(), dws.get(), tokens, in, out}, dy.get(),
                  y_f32 ? OutType::kFloat32 : OutType::kBfloat16, mode, dacc.get());
  ASSERT_TRUE(s.ok()) << what << ": " << s;
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> raw(tokens * out * (y_f32 ? 4 : 2));
  ASSERT_CUDA(cudaMemcpy(raw.data(), dy.get(), raw.size(), cudaMemcpyDeviceToHost));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0, mag = 0;
      for (int64_t i = 0; i < in; ++i) {
        const double p = double{E4M3ToFloat(xq[t * in + i])} * E4M3ToFloat(c.w.codes[o * in + i]);
        acc += p;
        mag += std::fabs(p);
      }
      const double scale = double{xs[t]} * c.w.row_scale[o];
      const double ref = acc * scale;
      const int64_t k = t * out + o;
      const double got = y_f32 ? reinterpret_cast<const float*>(raw.data())[k]
                               : __bfloat162float(reinterpret_cast<const Bf16*>(raw.data())[k]);
      const double tol = (mag * in * 6e-8 + std::fabs(acc) * 4e-7) * scale +
                         (y_f32 ? 0 : std::fabs(ref) * 4e-3) + 1e-30;
      ASSERT_NEAR(got, ref, tol) << what << " at " << t << "," << o;
    }
  }
}

TEST_F(Fp8GemmTest, RowwiseGemmMatchesFp64InEveryMode) {
  Fp8Gemm gemm;
  ASSERT_TRUE(gemm.Init(nullptr).ok());
  for (bool y_f32 : {true, false}) {
    for (auto [t, in, out] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 48},
                              {5, 128, 96},
                              {64, 256, 320},
                              {333, 512, 128}}) {
      CheckGemm(gemm, Fp8ScaleMode::kEpilogue, y_f32, t, in, out);
      if (HasFatalFailure()) return;
      const OutType type = y_f32 ? OutType::kFloat32 : OutType::kBfloat16;
      const Fp8GemmArgs shape{nullptr, nullptr, nullptr, nullptr, t, in, out};
      if (gemm.ModeFor(shape, type) != Fp8ScaleMode::kOuterVector) {
        std::printf("cuBLASLt offers no outer-vector FP8 scales for %lldx%lld->%lld %s\n",
                    static_cast<long long>(t), static_cast<long long>(in),
                    static_cast<long long>(out), y_f32 ? "fp32" : "bf16");
        continue;
      }
      CheckGemm(gemm, Fp8ScaleMode::kOuterVector, y_f32, t, in, out);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace cpfill::runtime::cuda
