#include "rpc/transport/internal/spin_poll.h"

#include <sched.h>
#include <time.h>

namespace ddprpc::rpc::transport {

int64_t SpinPoll::now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void SpinPoll::yield() { sched_yield(); }

SpinPoll& SpinPoll::this_thread(int64_t max_ns) {
  thread_local SpinPoll spin(0);
  if (spin.max_ns_ != max_ns) spin = SpinPoll(max_ns);
  return spin;
}

int SpinPoll::poll(pollfd* fds, nfds_t n, int timeout_ms) {
  if (timeout_ms == 0) return ::poll(fds, n, 0);
  int r = 0;
  if (spin([&] { return (r = ::poll(fds, n, 0)) != 0; })) return r;
  r = ::poll(fds, n, timeout_ms);
  slept();
  return r;
}

}  // namespace ddprpc::rpc::transport
