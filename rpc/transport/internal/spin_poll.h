// poll(2) that looks without sleeping for a short while first.
//
// A thread that sleeps in poll costs its wake-up when the bytes come: on a
// virtual machine whose idle CPU halts, tens of microseconds, more than a
// whole small call on the same-host path. SpinPoll::poll looks (poll with
// no timeout, yielding the CPU to any other runnable thread between looks)
// for up to this thread's spin budget, and sleeps in poll only after it.
//
// The budget adapts per thread, as an adaptive mutex's spin count does: a
// wait that ended within the budget keeps it at its maximum, one that did
// not halves it (down to none), and a thread without budget tries a full
// one again every kProbeEvery waits (back to none if that one fails too). Threads that wait long for each
// message (a busy host, a slow peer) so stop spinning after a few waits,
// and threads of a quick exchange keep spinning.
//
// Spinning pays only while the processes that exchange messages have a CPU
// each: it is off in a process until set_enabled(true) (the same-host
// transport's call, once it knows how many of the job's workers share this
// host). The maximum is the process's spin budget (spin_budget.h:
// DDPRPC_SPIN_US).
#pragma once

#include <poll.h>

#include <cstdint>

namespace ddprpc::rpc::transport {

class SpinPoll {
 public:
  static constexpr int kProbeEvery = 32;

  // Whether any thread of this process spins (off until set).
  static void set_enabled(bool on);
  static bool enabled();

  // As ::poll(fds, n, timeout_ms), after spinning within `budget`'s
  // current allowance (updated here). timeout_ms 0 never spins.
  int poll(pollfd* fds, nfds_t n, int timeout_ms);

  // This thread's current budget, in nanoseconds.
  int64_t budget_ns() const { return budget_ns_; }

  // The calling thread's SpinPoll.
  static SpinPoll& this_thread();

  explicit SpinPoll(int64_t max_ns) : max_ns_(max_ns), budget_ns_(max_ns) {}

 private:
  const int64_t max_ns_;
  int64_t budget_ns_;
  int waits_without_budget_ = 0;
};

}  // namespace ddprpc::rpc::transport
