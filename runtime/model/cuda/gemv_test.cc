// GPU tests of the small-batch linear kernel (gemv.h) against an fp64 reference on fresh random
// bf16 inputs, outputs poisoned with NaN first: every token count, fp32 and bf16 outputs, rows
// whose length is not a multiple of the unrolled stride, outputs not a multiple of a CTA's warps.
// Skips without a GPU.
#include "runtime/model/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/knobs.h"
#include "gtest/gtest.h"
#include "runtime/model/cuda/device_test_util.h"

namespace cpfill::runtime::cuda {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

using Bf16 = __nv_bfloat16;

class SmallBatchLinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device visible: the small-batch linear tests need a GPU host";
    }
    if (!knobs::Bool(knobs::kDecodeGemv)) {
      GTEST_SKIP() << "CPFILL_DECODE_GEMV=0 turns the small-batch kernel off";
    }
  }
};

// y = x w^T on the GPU against fp64 on the same bf16 numbers. The bound scales with the sum of
// |products| (fp32 accumulation in another order), plus bf16 rounding of y when y is bf16.
void Check(int64_t tokens, int64_t in, int64_t out, bool y_f32, uint64_t seed) {
  const std::string what = absl::StrCat(tokens, " x ", in, " -> ", out, y_f32 ? " fp32" : " bf16");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<Bf16> x(tokens * in), w(out * in);
  for (Bf16& e : x) e = __float2bfloat16(u(rng));
  for (Bf16& e : w) e = __float2bfloat16(u(rng));
  const DevicePtr<Bf16> dx = ToDevice(x), dw = ToDevice(w);
  const size_t y_bytes = tokens * out * (y_f32 ? 4 : 2);
  std::vector<uint8_t> poison(y_bytes, 0xFF);  // NaN in fp32 and in bf16
  const DevicePtr<uint8_t> dy = ToDevice(poison);
  ASSERT_TRUE(dx && dw && dy) << what;
  ASSERT_TRUE(SmallBatchLinearApplies(tokens, in, dx.get(), dw.get(), dy.get())) << what;
  const absl::Status s =
      SmallBatchLinear(dx.get(), tokens, in, dw.get(), out, dy.get(), y_f32, nullptr);
  ASSERT_TRUE(s.ok()) << what << ": " << s;
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> y(y_bytes);
  ASSERT_CUDA(cudaMemcpy(y.data(), dy.get(), y_bytes, cudaMemcpyDeviceToHost));

  int64_t bad = 0;
  double worst = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double ref = 0, mag = 0;
      for (int64_t i = 0; i < in; ++i) {
        const double p =
            double(__bfloat162float(x[t * in + i])) * double(__bfloat162float(w[o * in + i]));
        ref += p;
        mag += std::fabs(p);
      }
      const size_t k = t * out + o;
      const double got = y_f32 ? reinterpret_cast<const float*>(y.data())[k]
                               : __bfloat162float(reinterpret_cast<const Bf16*>(y.data())[k]);
      const double bound = 1e-5 * mag + (y_f32 ? 0.0 : std::ldexp(std::fabs(ref), -8));
      const double err = std::fabs(got - ref);
      worst = std::max(worst, err / std::max(bound, 1e-30));
      if (!(err <= bound)) ++bad;  // NaN (unwritten) counts as bad
    }
  }
  EXPECT_EQ(bad, 0) << what << ": worst error / bound " << worst;
}

TEST_F(SmallBatchLinearTest, EveryTokenCountAgainstFp64) {
  for (int64_t tokens = 1; tokens <= kSmallBatchMaxTokens; ++tokens) {
    Check(tokens, 4096, 1029, /*y_f32=*/true, 100 + tokens);
    Check(tokens, 4096, 1029, /*y_f32=*/false, 200 + tokens);
  }
}

TEST_F(SmallBatchLinearTest, RowsThatEndInsideTheUnrolledStride) {
  // 8, 264 and 14344 elements: one chunk, a chunk past 32, a tail past the unrolled loop.
  for (int64_t in : {8, 264, 14344}) {
    Check(1, in, 37, true, in);
    Check(5, in, 9, false, in + 1);
  }
}

TEST_F(SmallBatchLinearTest, RefusesWhatItCannotRun) {
  std::vector<Bf16> buf(64);
  const DevicePtr<Bf16> owned = ToDevice(buf);
  Bf16* d = owned.get();
  ASSERT_NE(d, nullptr);
  EXPECT_FALSE(SmallBatchLinearApplies(kSmallBatchMaxTokens + 1, 16, d, d, d));
  EXPECT_FALSE(SmallBatchLinearApplies(1, 12, d, d, d));      // not a multiple of 8
  EXPECT_FALSE(SmallBatchLinearApplies(1, 16, d + 1, d, d));  // x misaligned
  const absl::Status s = SmallBatchLinear(d, 9, 16, d, 2, d, true, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace cpfill::runtime::cuda
