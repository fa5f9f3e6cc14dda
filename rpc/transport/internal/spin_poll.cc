#include "rpc/transport/internal/spin_poll.h"

#include <sched.h>
#include <time.h>


namespace ddprpc::rpc::transport {
namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Below this a budget is not worth a look.
constexpr int64_t kMinSpinNs = 2000;

}  // namespace

SpinPoll& SpinPoll::this_thread(int64_t max_ns) {
  thread_local SpinPoll spin(0);
  if (spin.max_ns_ != max_ns) spin = SpinPoll(max_ns);
  return spin;
}

int SpinPoll::poll(pollfd* fds, nfds_t n, int timeout_ms) {
  if (timeout_ms != 0 && max_ns_ > 0) {
    int64_t budget = budget_ns_;
    const bool probe = budget < kMinSpinNs && ++waits_without_budget_ >= kProbeEvery;
    if (probe) budget = max_ns_;
    if (budget >= kMinSpinNs) {
      waits_without_budget_ = 0;
      const int64_t end = now_ns() + budget;
      for (;;) {
        const int r = ::poll(fds, n, 0);
        if (r != 0) {
          budget_ns_ = max_ns_;
          return r;
        }
        if (now_ns() >= end) break;
        sched_yield();
      }
      budget_ns_ = probe ? 0 : budget / 2;
    }
  }
  return ::poll(fds, n, timeout_ms);
}

}  // namespace ddprpc::rpc::transport
