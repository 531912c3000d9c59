#include "base/thread_pool.h"

#include <sys/resource.h>

#include <atomic>
#include <cstdlib>
#include <system_error>
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

// ASan reserves terabytes of address space for its shadow: no cap on it can be tested there.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPFILL_TEST_UNDER_ASAN 1
#endif
#endif
#if !defined(__SANITIZE_ADDRESS__) && !defined(CPFILL_TEST_UNDER_ASAN)
// A pool whose threads cannot all start (the address space capped, so their stacks cannot be
// mapped) throws std::system_error with the started threads joined, rather than terminating the
// process: the command reports it (launch/job/job.h). In a child process, whose limit dies with it.
// In the child: exits 7 when the pool threw std::system_error, 1 when it started every thread.
[[noreturn]] void StartPoolPastTheAddressSpace() {
  rlimit cap{};
  cap.rlim_cur = cap.rlim_max = 512ull << 20;
  setrlimit(RLIMIT_AS, &cap);
  try {
    cpfill::ThreadPool pool(4096);  // 4096 stacks of 8 MiB: far past 512 MiB
  } catch (const std::system_error&) {
    std::_Exit(7);
  }
  std::_Exit(1);
}

TEST(ThreadPoolDeathTest, AThreadThatCannotStartIsAnErrorNotATermination) {
  EXPECT_EXIT(StartPoolPastTheAddressSpace(), ::testing::ExitedWithCode(7), "");
}
#endif
