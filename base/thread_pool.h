// cpfill/base/thread_pool.h — a fixed pool of worker threads with a blocking ParallelFor.
//
// CPU kernels split work into independent items (a query tile of one head group, say) and run
// them on the pool; the caller's thread takes part, so a pool of 1 runs everything inline.
//
//   ThreadPool pool(4);
//   pool.ParallelFor(num_items, [&](int64_t item) { Work(item); });
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cpfill {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 means no extra threads. 0 picks the hardware count.
  // Throws std::system_error, with no thread left running, when a thread cannot start.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), spread over the pool; returns when all are done.
  // Items are handed out dynamically (an atomic counter), so uneven items balance themselves.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t job_size_ = 0;
  int64_t next_item_ = 0;
  int64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stop_ = false;
};

}  // namespace cpfill
