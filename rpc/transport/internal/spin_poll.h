// poll(2), or any other wait, that looks without sleeping for a short
// while first.
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
// each, and it costs CPU time the program may want elsewhere: the maximum
// is the caller's (the transport's TransportOptions::max_spin, 0 unless the
// program asks for it, and 0 when the job's workers on this host outnumber
// its CPUs). The gRPC transport's completion-queue waits spin through
// spin() in the same way.
#pragma once

#include <poll.h>

#include <cstdint>

namespace ddprpc::rpc::transport {

class SpinPoll {
 public:
  static constexpr int kProbeEvery = 32;

  // As ::poll(fds, n, timeout_ms), after spinning within `budget`'s
  // current allowance (updated here). timeout_ms 0 never spins.
  int poll(pollfd* fds, nfds_t n, int timeout_ms);

  // Calls `look` (which must not block) until it returns true, yielding
  // the CPU between calls, for up to this thread's current allowance
  // (updated here as for poll()). True when a look succeeded; false when
  // the allowance ran out or there was none, and the caller then sleeps
  // in its own wait.
  template <typename Look>
  bool spin(Look&& look) {
    if (max_ns_ <= 0) return false;
    int64_t budget = budget_ns_;
    const bool probe = budget < kMinSpinNs && ++waits_without_budget_ >= kProbeEvery;
    if (probe) budget = max_ns_;
    if (budget < kMinSpinNs) return false;
    waits_without_budget_ = 0;
    const int64_t end = now_ns() + budget;
    for (;;) {
      if (look()) {
        budget_ns_ = max_ns_;
        return true;
      }
      if (now_ns() >= end) break;
      yield();
    }
    budget_ns_ = probe ? 0 : budget / 2;
    return false;
  }

  // This thread's current budget, in nanoseconds.
  int64_t budget_ns() const { return budget_ns_; }

  // The calling thread's SpinPoll for waits of at most `max_ns` spinning.
  // A maximum other than the last call's starts the budget afresh.
  static SpinPoll& this_thread(int64_t max_ns);

  explicit SpinPoll(int64_t max_ns) : max_ns_(max_ns), budget_ns_(max_ns) {}

 private:
  // Below this a budget is not worth a look.
  static constexpr int64_t kMinSpinNs = 2000;
  static int64_t now_ns();
  static void yield();

  int64_t max_ns_;
  int64_t budget_ns_;
  int waits_without_budget_ = 0;
};

}  // namespace ddprpc::rpc::transport
