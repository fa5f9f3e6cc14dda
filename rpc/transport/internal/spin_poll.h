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
// wait that ended within the budget, or soon after it (within twice the
// maximum), makes it full; a longer one halves it (down to none), and a
// thread without budget tries a full one again every kProbeEvery waits
// (back to none if that one fails too). Threads that wait long for each
// message (a busy host, a slow peer) so stop spinning after a few waits,
// and threads of a quick exchange keep spinning, or start again: two that
// stopped answer each other within a few wake-ups.
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
  // the CPU between calls, for up to this thread's current allowance. True
  // when a look succeeded (the allowance is then full again). False when
  // the allowance ran out or there was none: the caller then sleeps in its
  // own wait and calls slept() once that returns.
  template <typename Look>
  bool spin(Look&& look) {
    wait_start_ns_ = 0;
    if (max_ns_ <= 0) return false;
    wait_start_ns_ = now_ns();
    int64_t budget = budget_ns_;
    probing_ = budget < kMinSpinNs && ++waits_without_budget_ >= kProbeEvery;
    if (probing_) budget = max_ns_;
    spun_ns_ = 0;
    if (budget < kMinSpinNs) return false;
    waits_without_budget_ = 0;
    spun_ns_ = budget;
    const int64_t end = wait_start_ns_ + budget;
    for (;;) {
      if (look()) {
        budget_ns_ = max_ns_;
        wait_start_ns_ = 0;
        return true;
      }
      if (now_ns() >= end) break;
      yield();
    }
    return false;
  }

  // After the sleep that followed a spin() that found nothing. A wait
  // that ended within twice the maximum, spun or not, makes the allowance
  // full again: a little more looking would have caught it, and in an
  // exchange both sides answer sooner while both look (two threads that
  // had stopped looking start again). A longer wait halves what was spun
  // (a probe that failed leaves none); an unspun long one changes nothing.
  void slept() {
    if (wait_start_ns_ == 0) return;
    const int64_t waited = now_ns() - wait_start_ns_;
    wait_start_ns_ = 0;
    if (waited <= 2 * max_ns_) {
      budget_ns_ = max_ns_;
      waits_without_budget_ = 0;
    } else if (spun_ns_ > 0) {
      budget_ns_ = probing_ ? 0 : spun_ns_ / 2;
    }
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
  // The wait that spin() began and slept() ends: when it began (0: none),
  // how long it looked, and whether that was a probe.
  int64_t wait_start_ns_ = 0;
  int64_t spun_ns_ = 0;
  bool probing_ = false;
};

}  // namespace ddprpc::rpc::transport
