#include "base/thread_pool.h"

namespace cpfill {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  // A thread that cannot start (std::system_error: the process's thread or memory limit) ends the
  // ones already started before the error leaves: destroying a joinable std::thread would
  // terminate the process, and the caller (launch/job/job.h's RunJob) reports the error instead.
  try {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  // Items are claimed under the lock: a claim is one increment, far cheaper than any item.
  while (true) {
    int64_t item;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_item_ >= job_size_) return;
      item = next_item_++;
    }
    (*job_)(item);
  }
}

void ThreadPool::WorkerLoop() {
  int64_t seen_generation = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen_generation; });
      if (stop_) return;
      seen_generation = generation_;
      ++busy_workers_;
    }
    RunItems();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --busy_workers_;
    }
    done_cv_.notify_all();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_size_ = n;
    next_item_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  RunItems();
  std::unique_lock<std::mutex> lock(mu_);
  // All items claimed; wait until every worker that joined this job has finished its item.
  done_cv_.wait(lock, [&] { return busy_workers_ == 0 && next_item_ >= job_size_; });
  job_ = nullptr;
  job_size_ = 0;
}

}  // namespace cpfill
