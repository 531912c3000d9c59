// GPU tests of the in-place token draw (token_draw.h) against the host's SampleToken on the same
// fresh random logits, ids poisoned first: greedy, temperature, top-k, top-p and both, over
// Llama 3's vocabulary in one part and a vocabulary in TP slices, and logits with many ties at
// the cut (kept by lower id, as the host keeps them). Skips without a GPU.
#include "runtime/model/cuda/token_draw.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/model/cuda/device_test_util.h"
#include "runtime/model/sampling.h"
#include "runtime/model/sampling_draw.h"

namespace cpfill::runtime::cuda {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

class TokenDrawTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device visible: the token draw tests need a GPU host";
    }
  }
};

const std::vector<SamplingParams>& Params() {
  static const std::vector<SamplingParams> params = {
      {},
      {.temperature = 1.0, .seed = 1},
      {.temperature = 0.6, .top_k = 50, .seed = 2},
      {.temperature = 1.0, .top_p = 0.9, .seed = 3},
      {.temperature = 0.8, .top_k = 1000, .top_p = 0.95, .seed = 4},
      {.temperature = 1.5, .top_p = 0.05, .seed = 5},
      {.temperature = 1.0, .top_k = 3, .seed = 6},
      {.temperature = 1.0, .top_k = 1, .seed = 7},
      {.temperature = 1.0, .top_k = 1 << 20, .top_p = 1.0, .seed = 8},
      {.temperature = 0.3, .top_p = 0.5, .seed = 9}};
  return params;
}

// `rows` rows of `vocab` logits, stored as `slices` parts (part s of row r at row s * rows + r);
// every param set drawn at `steps` steps from every row, against SampleToken on the whole row.
void Check(const std::vector<float>& whole, int64_t rows, int64_t vocab, int slices, int steps,
           const std::string& what) {
  const int64_t part = vocab / slices;
  std::vector<float> stored(whole.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int s = 0; s < slices; ++s) {
      std::copy_n(whole.begin() + r * vocab + s * part, part,
                  stored.begin() + (s * rows + r) * part);
    }
  }
  std::vector<DeviceTokenDraw> draws;
  std::vector<int32_t> want;
  for (int64_t r = 0; r < rows; ++r) {
    const std::span<const float> row(whole.data() + r * vocab, vocab);
    for (const SamplingParams& p : Params()) {
      for (int step = 0; step < steps; ++step) {
        draws.push_back({.scale = p.temperature > 0 ? 1.0 / p.temperature : 0.0,
                         .top_p = p.top_p,
                         .top_k = p.top_k,
                         .key = DrawKey(p.seed, step),
                         .row = r});
        want.push_back(SampleToken(row, p, step).id);
      }
    }
  }
  auto logits = ToDevice(stored);
  auto specs = ToDevice(draws);
  auto ids = ToDevice(std::vector<int32_t>(draws.size(), -7));  // poisoned
  ASSERT_TRUE(logits && specs && ids);
  ASSERT_TRUE(DrawTokens(logits.get(), rows, part, slices, specs.get(),
                         static_cast<int>(draws.size()), ids.get(), nullptr)
                  .ok());
  std::vector<int32_t> got(draws.size());
  ASSERT_CUDA(cudaMemcpy(got.data(), ids.get(), got.size() * 4, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int param = static_cast<int>(i / steps % Params().size());
    if (got[i] != want[i] && ++wrong <= 5) {
      ADD_FAILURE() << what << ": draw " << i << " (params " << param << ", row " << draws[i].row
                    << ") took " << got[i] << ", the host takes " << want[i];
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": of " << got.size() << " draws";
}

std::vector<float> Normal(int64_t n, double sd, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, static_cast<float>(sd));
  std::vector<float> z(n);
  for (float& x : z) x = d(rng);
  return z;
}

TEST_F(TokenDrawTest, LlamaVocabularyEqualsTheHostsDraw) {
  const uint64_t seed = std::random_device{}();
  constexpr int64_t kVocab = 128256, kRows = 4;
  Check(Normal(kRows * kVocab, 3.0, seed), kRows, kVocab, 1, 3,
        absl::StrCat("128256 ids, seed ", seed));
}

TEST_F(TokenDrawTest, TpSlicesEqualTheWholeRowsDraw) {
  const uint64_t seed = std::random_device{}();
  constexpr int64_t kVocab = 4000, kRows = 3;
  for (int slices : {2, 4}) {
    Check(Normal(kRows * kVocab, 2.0, seed), kRows, kVocab, slices, 4,
          absl::StrCat(kVocab, " ids in ", slices, " slices, seed ", seed));
  }
}

TEST_F(TokenDrawTest, TiesAtTheCutAreKeptByLowerId) {
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  constexpr int64_t kVocab = 96, kRows = 5;
  std::vector<float> z(kRows * kVocab);
  for (float& x : z) x = static_cast<float>(rng() % 4);  // four values: ties everywhere
  Check(z, kRows, kVocab, 1, 6, absl::StrCat("96 ids of four values, seed ", seed));
}

}  // namespace
}  // namespace cpfill::runtime::cuda
