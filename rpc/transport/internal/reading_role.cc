#include "rpc/transport/internal/reading_role.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "glog/logging.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/thread_policy.h"

namespace ddprpc::rpc::internal {

ReadingRole::ReadingRole(absl::Mutex* mu, Options options, Hold hold)
    : mu_(mu), options_(options), hold_(std::move(hold)) {}

ReadingRole::~ReadingRole() {
  // join() left nothing to join; a thread still here would outlive us.
  CHECK(threads_.empty()) << options_.name << ": the reading role's threads were not joined";
}

bool ReadingRole::add_thread() {
  if (stop_) return false;
  const int64_t me = next_id_++;
  try {
    fault_point("transport.spawn_thread");
    threads_.emplace(me, std::thread([this, me] { run(me); }));
  } catch (const std::exception& e) {
    LOG(ERROR) << options_.name << ": cannot start a thread: " << e.what();
    return false;
  }
  ++running_;
  return true;
}

void ReadingRole::hand_off() {
  holder_ = kNobody;
  if (idle_ == 0) add_thread();
}

void ReadingRole::stop() { stop_ = true; }

void ReadingRole::join() {
  std::map<int64_t, std::thread> threads;
  {
    absl::MutexLock lock(mu_);
    auto gone = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) { return running_ == 0; };
    mu_->Await(absl::Condition(&gone));
    left_.clear();
    threads.swap(threads_);
  }
  for (auto& [id, t] : threads) t.join();
}

std::vector<std::thread> ReadingRole::take_left() {
  std::vector<std::thread> out;
  for (int64_t id : left_) {
    auto it = threads_.find(id);
    if (it == threads_.end()) continue;
    out.push_back(std::move(it->second));
    threads_.erase(it);
  }
  left_.clear();
  return out;
}

void ReadingRole::run(int64_t me) {
  apply_thread_policy(options_.batch_scheduling);
  absl::MutexLock lock(mu_);
  for (;;) {
    ++idle_;
    auto can_hold = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) {
      return holder_ == kNobody || stop_;
    };
    mu_->Await(absl::Condition(&can_hold));
    --idle_;
    if (stop_) break;
    holder_ = me;
    // Threads that left are joined here, off the mutex: a holder is the one
    // thread sure to come by after each hand-off.
    std::vector<std::thread> left = take_left();
    mu_->Unlock();
    for (std::thread& t : left) t.join();
    try {
      hold_(me);
    } catch (const std::exception& e) {
      LOG(ERROR) << options_.name << ": a reading thread failed: " << e.what();
    } catch (...) {
      LOG(ERROR) << options_.name << ": a reading thread failed";
    }
    mu_->Lock();
    // Returned with the role (the server stops): the role is free.
    if (holder_ == me) holder_ = kNobody;
    if (stop_ || (options_.max_idle >= 0 && idle_ >= options_.max_idle)) break;
  }
  --running_;
  left_.push_back(me);
}

RoleWatchdog::RoleWatchdog(absl::Mutex* mu, absl::Duration after_wake, Look look)
    : mu_(mu), after_wake_(after_wake), look_(std::move(look)) {}

RoleWatchdog::~RoleWatchdog() { CHECK(!thread_.joinable()) << "RoleWatchdog: stop() was not called"; }

void RoleWatchdog::start(bool batch_scheduling) {
  thread_ = std::thread([this, batch_scheduling] {
    apply_thread_policy(batch_scheduling);
    loop();
  });
}

void RoleWatchdog::wake() {
  if (!parked_.load()) return;
  absl::MutexLock lock(mu_);
  parked_.store(false);
}

void RoleWatchdog::stop() {
  {
    absl::MutexLock lock(mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void RoleWatchdog::loop() {
  absl::MutexLock lock(mu_);
  while (!stop_) {
    parked_.store(true);
    absl::Duration wait = look_();
    if (stop_) return;
    if (wait != absl::InfiniteDuration()) {
      wait = std::max(wait, kMinWait);
    } else {
      auto unparked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) {
        return stop_ || !parked_.load();
      };
      mu_->Await(absl::Condition(&unparked));
      if (stop_) return;
      wait = after_wake_;
    }
    parked_.store(false);
    // Zero only right after a wake (after_wake of zero): look at once.
    if (wait > absl::ZeroDuration()) mu_->AwaitWithTimeout(absl::Condition(&stop_), wait);
  }
}

}  // namespace ddprpc::rpc::internal
