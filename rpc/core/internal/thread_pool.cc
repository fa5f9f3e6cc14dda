#include "rpc/core/internal/thread_pool.h"

#include <exception>

#include "glog/logging.h"
#include "rpc/core/internal/thread_policy.h"

namespace ddprpc::rpc::internal {

ThreadPool::ThreadPool(int num_threads, bool batch_scheduling) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, batch_scheduling] { loop(batch_scheduling); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

bool ThreadPool::try_run(std::function<void()> task, size_t max_queued) {
  absl::MutexLock lock(&mu_);
  if (tasks_.size() >= max_queued) return false;
  tasks_.push_back(std::move(task));
  return true;
}

int ThreadPool::busy() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

void ThreadPool::loop(bool batch_scheduling) {
  apply_thread_policy(batch_scheduling);
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !tasks_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      ++busy_;
    }
    try {
      task();
    } catch (const std::exception& e) {
      LOG(ERROR) << "rpc: a task on a pool thread threw (ignored): " << e.what();
    } catch (...) {
      LOG(ERROR) << "rpc: a task on a pool thread threw (ignored)";
    }
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

}  // namespace ddprpc::rpc::internal
