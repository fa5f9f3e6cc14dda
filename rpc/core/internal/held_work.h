// Work a thread holds back until it finishes what it is doing (used by the
// callee to send the replies a request's handler completes when it
// returns; see rpc::send_completed_replies in future.h).
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace ddprpc::rpc::internal {

// Work a thread holds back until it finishes what it is doing: RpcAgent
// writes the replies that a request's handler completes (async execution,
// e.g. a batch answered by its last caller) when the handler returns, so
// completing a future costs no socket writes inside the handler (nor under
// a lock it holds). A thread that is about to wait for a future runs its
// held work first, so nothing held back can wait for what the thread waits
// for. Scopes nest; each runs what it holds when it ends. Work must not throw.
class HeldWork {
 public:
  HeldWork() : saved_(current_) { current_ = this; }
  ~HeldWork() {
    run();
    current_ = saved_;
  }
  HeldWork(const HeldWork&) = delete;
  HeldWork& operator=(const HeldWork&) = delete;

  // The innermost scope on this thread, or nullptr.
  static HeldWork* current() { return current_; }
  // Within it, this thread holds nothing back (current() is nullptr): a
  // thread that reads replies while it waits runs their callbacks as a
  // thread outside any scope would, since work held until its wait ends
  // could be what the awaited reply depends on.
  class Suspend {
   public:
    Suspend() : saved_(current_) { current_ = nullptr; }
    ~Suspend() { current_ = saved_; }
    Suspend(const Suspend&) = delete;
    Suspend& operator=(const Suspend&) = delete;

   private:
    HeldWork* const saved_;
  };
  void add(std::function<void()> work) { work_.push_back(std::move(work)); }
  // Runs what is held, in the order it was added (work may add more).
  void run() {
    while (!work_.empty()) {
      std::vector<std::function<void()>> batch;
      batch.swap(work_);
      for (auto& work : batch) work();
    }
  }

 private:
  static inline thread_local HeldWork* current_ = nullptr;
  HeldWork* const saved_;
  std::vector<std::function<void()>> work_;
};

}  // namespace ddprpc::rpc::internal
