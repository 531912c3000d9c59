#include "base/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill {
namespace {

TEST(ThreadPool, RunsEveryItemExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "threads " << threads;
    }
  }
}

TEST(ThreadPool, BackToBackJobsDoNotMix) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 200; ++round) {
    pool.ParallelFor(10, [&](int64_t i) { sum.fetch_add(i + round); });
  }
  int64_t expect = 0;
  for (int round = 0; round < 200; ++round) expect += 45 + 10 * round;
  EXPECT_EQ(sum.load(), expect);
}

}  // namespace
}  // namespace cpfill
