// GPU test of ExpandPositionRuns against the host's sharding::ExpandPositions on fresh random
// runs (one run, many short ones as a CP decode step leaves, long and short mixed), the output
// poisoned first and checked up to one row past the end. Skips without a GPU.
#include "parallel/cuda/position_runs.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "sharding/plan.h"

namespace cpfill::parallel::cuda {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

class PositionRunsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device visible: the position-run tests need a GPU host";
    }
  }
};

// `count` runs of 1 to max_length rows at random positions.
std::vector<sharding::PositionRun> RandomRuns(int count, int64_t max_length, std::mt19937& rng) {
  std::vector<sharding::PositionRun> runs;
  for (int i = 0; i < count; ++i) {
    runs.push_back({.begin = std::uniform_int_distribution<int64_t>(0, 1 << 20)(rng),
                    .length = std::uniform_int_distribution<int64_t>(1, max_length)(rng)});
  }
  return runs;
}

TEST_F(PositionRunsTest, DeviceExpansionEqualsTheHosts) {
  std::mt19937 rng(11);
  const std::vector<std::vector<sharding::PositionRun>> cases = {
      {{.begin = 0, .length = 16384}},  // one sequence on one rank
      RandomRuns(4096, 1, rng),         // decode tokens round-robin over CP ranks
      RandomRuns(513, 3000, rng),       // chunks of 2N sharding and decode runs mixed
      RandomRuns(7, 70000, rng),
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::vector<int32_t> want = sharding::ExpandPositions(cases[c]);
    const int64_t rows = static_cast<int64_t>(want.size());
    std::vector<int32_t> packed;
    int64_t row = 0;
    for (const sharding::PositionRun& run : cases[c]) {
      packed.push_back(static_cast<int32_t>(row));
      packed.push_back(static_cast<int32_t>(run.begin));
      row += run.length;
    }
    int32_t *runs = nullptr, *out = nullptr;
    ASSERT_CUDA(cudaMalloc(&runs, packed.size() * sizeof(int32_t)));
    ASSERT_CUDA(cudaMalloc(&out, (rows + 1) * sizeof(int32_t)));
    ASSERT_CUDA(
        cudaMemcpy(runs, packed.data(), packed.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemset(out, 0xA5, (rows + 1) * sizeof(int32_t)));  // poison, one row past
    ASSERT_CUDA(ExpandPositionRuns(runs, static_cast<int>(cases[c].size()), out, rows, nullptr));
    std::vector<int32_t> got(rows + 1);
    ASSERT_CUDA(cudaMemcpy(got.data(), out, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cudaFree(runs);
    cudaFree(out);
    int32_t poison;
    std::memset(&poison, 0xA5, sizeof(poison));
    EXPECT_EQ(got.back(), poison) << "case " << c << ": a row past the end was written";
    got.pop_back();
    EXPECT_EQ(got, want) << "case " << c;
  }
}

TEST_F(PositionRunsTest, RefusesRowsWithoutRunsAndAcceptsZeroRows) {
  int32_t* out = nullptr;
  EXPECT_EQ(ExpandPositionRuns(nullptr, 0, out, 0, nullptr), cudaSuccess);
  EXPECT_EQ(ExpandPositionRuns(nullptr, 0, out, 5, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cpfill::parallel::cuda
