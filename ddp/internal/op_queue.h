// Runs a process group's operations one at a time, in the order issued, on
// a thread of its own, and gives each a Work that reports its outcome; or
// on the calling thread (run_now), when nothing else is queued or running.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "ddp/process_group.h"

namespace ddprpc::ddp::internal {

class QueuedWork : public Work {
 public:
  explicit QueuedWork(std::string what) : what_(std::move(what)) {}
  void wait(absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) {
      throw std::runtime_error(what_ + " did not complete within " + absl::FormatDuration(timeout));
    }
    if (error_) throw std::runtime_error(what_ + " failed: " + *error_);
  }
  bool completed() const override {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  // `error`: what the operation threw, if it failed.
  void finish(std::optional<std::string> error) {
    absl::MutexLock lock(&mu_);
    error_ = std::move(error);
    done_ = true;
  }

 private:
  const std::string what_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::string> error_ ABSL_GUARDED_BY(mu_);
};

class OpQueue {
 public:
  OpQueue() : thread_([this] { loop(); }) {}
  // Finishes the queued operations, then stops.
  ~OpQueue() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  // `what` names the operation in errors ("ProcessGroupGloo allreduce (rank 0 of 2)").
  std::shared_ptr<Work> enqueue(std::string what, std::function<void()> op) {
    auto work = std::make_shared<QueuedWork>(std::move(what));
    absl::MutexLock lock(&mu_);
    queue_.emplace_back(std::move(op), work);
    return work;
  }

  // enqueue(what, op)->wait(timeout), but run on this thread when the queue
  // is idle (nothing queued or running): its thread is neither woken for it
  // nor waited for, and operations enqueued meanwhile run after it. An
  // operation run here is bounded by its own deadline, not by `timeout`.
  void run_now(std::string what, std::function<void()> op, absl::Duration timeout) {
    std::shared_ptr<QueuedWork> queued;
    {
      absl::MutexLock lock(&mu_);
      if (!queue_.empty() || running_) {
        queued = std::make_shared<QueuedWork>(what);
        queue_.emplace_back(std::move(op), queued);
      } else {
        running_ = true;
      }
    }
    if (queued) return queued->wait(timeout);
    std::optional<std::string> error = run(op);
    {
      absl::MutexLock lock(&mu_);
      running_ = false;
    }
    if (error) throw std::runtime_error(what + " failed: " + *error);
  }

 private:
  // Runs `op`; what it throws, as text.
  static std::optional<std::string> run(const std::function<void()>& op) {
    try {
      op();
      return std::nullopt;
    } catch (const std::exception& e) {
      return std::string(e.what());
    } catch (...) {
      return std::string("an exception that is not a std::exception");
    }
  }

  void loop() {
    while (true) {
      std::pair<std::function<void()>, std::shared_ptr<QueuedWork>> item;
      {
        absl::MutexLock lock(&mu_);
        // An operation run_now runs goes first; then the queue, or the end.
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !running_ && (stopping_ || !queue_.empty());
        };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      std::optional<std::string> error = run(item.first);
      {
        absl::MutexLock lock(&mu_);
        running_ = false;
      }
      item.second->finish(std::move(error));
    }
  }

  absl::Mutex mu_;
  // State below is protected by mu_.
  std::deque<std::pair<std::function<void()>, std::shared_ptr<QueuedWork>>> queue_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // an operation runs (here or in run_now)
  std::thread thread_;  // last: starts after the state above exists
};

}  // namespace ddprpc::ddp::internal
