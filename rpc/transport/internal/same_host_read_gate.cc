#include "rpc/transport/internal/same_host_read_gate.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "rpc/transport/internal/spin_poll.h"

namespace ddprpc::rpc::transport::same_host {

ReadGate::~ReadGate() {
  for (const Driver& d : drivers) {
    if (d.wake_fd >= 0) ::close(d.wake_fd);
  }
  for (int fd : spare_fds) ::close(fd);
}

void ReadGate::wake_drivers() {
  const uint64_t one = 1;
  const std::thread::id me = std::this_thread::get_id();
  for (const Driver& d : drivers) {
    if (d.thread == me || d.wake_fd < 0) continue;
    ssize_t ignored = ::write(d.wake_fd, &one, sizeof(one));
    (void)ignored;
  }
}

namespace {

// The calling thread as one of the gate's drivers, for the scope of a
// drive_same_host (the outermost one of a thread registers it, with an
// eventfd from the gate's spares or a new one).
class DriverRegistration {
 public:
  explicit DriverRegistration(ReadGate* gate)
      : gate_(gate), me_(std::this_thread::get_id()) {
    absl::MutexLock lock(&gate_->mu);
    for (ReadGate::Driver& d : gate_->drivers) {
      if (d.thread != me_) continue;
      ++d.depth;
      wake_fd_ = d.wake_fd;
      return;
    }
    if (!gate_->spare_fds.empty()) {
      wake_fd_ = gate_->spare_fds.back();
      gate_->spare_fds.pop_back();
    } else {
      wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // -1: polls skip it
    }
    gate_->drivers.push_back({me_, wake_fd_, 1});
  }
  ~DriverRegistration() {
    absl::MutexLock lock(&gate_->mu);
    auto& drivers = gate_->drivers;
    auto it = std::find_if(drivers.begin(), drivers.end(),
                           [this](const ReadGate::Driver& d) { return d.thread == me_; });
    if (it == drivers.end() || --it->depth > 0) return;
    if (wake_fd_ >= 0) {
      uint64_t v;
      ssize_t ignored = ::read(wake_fd_, &v, sizeof(v));  // a wake nobody waits for now
      (void)ignored;
      gate_->spare_fds.push_back(wake_fd_);
    }
    drivers.erase(it);
  }
  DriverRegistration(const DriverRegistration&) = delete;
  DriverRegistration& operator=(const DriverRegistration&) = delete;

  int wake_fd() const { return wake_fd_; }

 private:
  ReadGate* const gate_;
  const std::thread::id me_;
  int wake_fd_ = -1;
};

// One wait of a driver on the channels whose reading role it holds (and
// its wake-up fd): reads what came, or checks the peers when nothing did.
void poll_and_read(const ReadGate& gate,
                   const std::vector<std::shared_ptr<DrivenChannel>>& reading, int wake_fd,
                   absl::Duration wait) {
  std::vector<pollfd> fds;
  fds.reserve(1 + 2 * reading.size());
  fds.push_back({wake_fd, POLLIN, 0});  // a reply handled elsewhere
  for (auto& ch : reading) {
    const bool out = ch->conn()->flush();
    fds.push_back({ch->conn()->fd(), static_cast<short>(POLLIN | (out ? POLLOUT : 0)), 0});
    fds.push_back({ch->conn()->wake_fd(), POLLIN, 0});
  }
  const int r = SpinPoll::this_thread(gate.settings->spin_ns.load(std::memory_order_relaxed))
                    .poll(fds.data(), fds.size(),
                          static_cast<int>(absl::ToInt64Milliseconds(wait) + 1));
  if (r > 0 && (fds[0].revents & POLLIN)) {
    uint64_t v;
    ssize_t ignored = ::read(wake_fd, &v, sizeof(v));
    (void)ignored;
  }
  for (size_t i = 0; i < reading.size() && r > 0; ++i) {
    if (fds[2 + 2 * i].revents & POLLIN) reading[i]->conn()->drain_wake();
    if (fds[1 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR)) reading[i]->read_one_or_end();
  }
  if (r == 0) {
    for (auto& ch : reading) ch->check_peer_or_end();
  }
}

}  // namespace

void drive_same_host(const std::shared_ptr<ReadGate>& gate_, const std::function<bool()>& done,
                     absl::Time deadline) {
  Lend lend(gate_.get(), /*same_host_side=*/false);
  DriverRegistration registered(gate_.get());
  // Slices bound how long a completion from elsewhere (a timeout, a
  // reply read by another thread) goes unnoticed.
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  const std::thread::id me = std::this_thread::get_id();
  // The roles this thread holds, kept until it returns: letting them go
  // between its waits would wake the channels' background readers to take
  // them, only for this thread to wait for them back.
  std::vector<std::shared_ptr<DrivenChannel>> reading;
  std::vector<bool> nested;
  auto release = [&] {
    absl::MutexLock lock(&gate_->mu);
    for (size_t i = 0; i < reading.size(); ++i) {
      if (!nested[i]) reading[i]->release_for_driver();
    }
  };
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    bool others = false;
    {
      absl::MutexLock lock(&gate_->mu);
      // Ended or closing channels are let go (close() waits for that).
      for (size_t i = 0; i < reading.size();) {
        if (!reading[i]->over()) {
          ++i;
          continue;
        }
        if (!nested[i]) reading[i]->release_for_driver();
        reading.erase(reading.begin() + i);
        nested.erase(nested.begin() + i);
      }
      auto& list = gate_->channels;
      for (size_t i = 0; i < list.size();) {
        std::shared_ptr<DrivenChannel> ch = list[i].lock();
        if (!ch) {
          list[i] = list.back();
          list.pop_back();
          continue;
        }
        ++i;
        if (std::find(reading.begin(), reading.end(), ch) != reading.end()) continue;
        bool is_nested;
        if (ch->claim_for_driver(me, &is_nested)) {
          reading.push_back(std::move(ch));
          nested.push_back(is_nested);
        } else if (ch->held_by_other(me)) {
          others = true;
        }
      }
      if (reading.empty() && others) {
        // Another thread reads: wait until it lets a role go or a reply
        // is handled (a slice at most), then look at done() again.
        const uint64_t seen = gate_->version;
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate_->mu) {
          return gate_->version != seen;
        };
        gate_->mu.AwaitWithTimeout(absl::Condition(&changed), std::min(kSlice, deadline - now));
      }
    }
    if (reading.empty()) {
      if (!others) break;  // no same-host channel to read
      continue;
    }
    // Messages read ahead first: polling the socket would not show them.
    bool read_ahead = false;
    for (auto& ch : reading) {
      if (!ch->conn()->has_buffered()) continue;
      read_ahead = true;
      ch->read_one_or_end();
    }
    if (!read_ahead) {
      poll_and_read(*gate_, reading, registered.wake_fd(), std::min(kSlice, deadline - now));
    }
  }
  release();
}

}  // namespace ddprpc::rpc::transport::same_host
