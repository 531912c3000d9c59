#include "base/random.h"

#include <cmath>

#include "gtest/gtest.h"

namespace cpfill {
namespace {

TEST(Random, UniformAtIsDeterministicAndInRange) {
  double sum = 0, sum_sq = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const float x = UniformAt(42, 7, i);
    ASSERT_GE(x, -1.0f);
    ASSERT_LT(x, 1.0f);
    ASSERT_EQ(x, UniformAt(42, 7, i));
    sum += x;
    sum_sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum_sq / n, 1.0 / 3.0, 0.01);  // variance of U(-1, 1)
}

TEST(Random, StreamsAndSeedsDiffer) {
  EXPECT_NE(UniformAt(1, 0, 5), UniformAt(2, 0, 5));
  EXPECT_NE(UniformAt(1, 0, 5), UniformAt(1, 1, 5));
}

}  // namespace
}  // namespace cpfill
