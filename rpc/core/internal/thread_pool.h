// A fixed-size pool of worker threads running queued tasks in FIFO order.
// A task that throws is logged; its exception never leaves the pool's thread.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ddprpc::rpc::internal {

class ThreadPool {
 public:
  // Its threads apply the runtime's thread policy with `batch_scheduling`
  // (thread_policy.h).
  explicit ThreadPool(int num_threads, bool batch_scheduling = false);
  // Runs the tasks still queued, then joins the threads.
  ~ThreadPool();

  void run(std::function<void()> task);
  // As run(), unless `max_queued` tasks are waiting already: then false.
  bool try_run(std::function<void()> task, size_t max_queued);
  // Threads currently running a task.
  int busy() const;
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void loop(bool batch_scheduling);

  mutable absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ddprpc::rpc::internal
