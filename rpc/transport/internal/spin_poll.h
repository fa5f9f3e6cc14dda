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
// each, and it costs CPU time the program may want elsewhere: the maximum
// is the caller's (the transport's TransportOptions::max_spin, 0 unless the
// program asks for it, and 0 when the job's workers on this host outnumber
// its CPUs).
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

  // This thread's current budget, in nanoseconds.
  int64_t budget_ns() const { return budget_ns_; }

  // The calling thread's SpinPoll for waits of at most `max_ns` spinning.
  // A maximum other than the last call's starts the budget afresh.
  static SpinPoll& this_thread(int64_t max_ns);

  explicit SpinPoll(int64_t max_ns) : max_ns_(max_ns), budget_ns_(max_ns) {}

 private:
  int64_t max_ns_;
  int64_t budget_ns_;
  int waits_without_budget_ = 0;
};

}  // namespace ddprpc::rpc::transport
