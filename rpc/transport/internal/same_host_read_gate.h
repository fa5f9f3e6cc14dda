// Who reads the replies of a same-host transport's channels (ReadGate),
// and the waits of callers that read their own replies (drive_same_host).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/transport/internal/same_host_connection.h"
#include "rpc/transport/transport.h"

namespace ddprpc::rpc::transport::same_host {

// What drive_same_host needs of a channel (SameHostChannel implements
// it): its reading role, claimed and let go with the gate's mutex held (a
// channel's role is guarded by the mutex of the gate it was opened with),
// and its messages, read one at a time by the role's holder.
class DrivenChannel {
 public:
  virtual ~DrivenChannel() = default;
  // With the gate's mutex held. Takes the role if free; returns whether
  // this thread now holds it (already held by this thread counts, `nested`
  // then set).
  virtual bool claim_for_driver(std::thread::id me, bool* nested) = 0;
  virtual void release_for_driver() = 0;
  // Ended, or being closed: a driver lets it go.
  virtual bool over() const = 0;
  // Another thread holds the role, or the channel is not ready to be read.
  virtual bool held_by_other(std::thread::id me) const = 0;

  // By the role's holder, without the gate's mutex.
  virtual Conn* conn() = 0;
  // Reads and handles one message; an error ends the channel.
  virtual void read_one_or_end() = 0;
  // Looks at the peer's process (now and then); ends the channel if gone.
  virtual void check_peer_or_end() = 0;
};

// Who reads the replies of a transport's channels. A channel's socket is
// read by one thread at a time, the holder of its reading role: a caller
// waiting for a reply (SameHostTransport::drive), so that the reply wakes
// only that caller, or else the channel's background thread, which reads
// while replies are expected, no caller holds reservations (SyncCallScope:
// callers that will wait and read) and no caller holds the role.
//
// Reservations are made for both transports at once (a scope does not know
// which its calls will use), so a thread that waits on one transport lends
// its reservations of the other back for the wait (Lend): a reply of the
// other kind that its wait depends on is then read by that transport's own
// background reader.
struct ReadGate {
  ReadGate() = default;
  ~ReadGate();  // closes the drivers' eventfds
  ReadGate(const ReadGate&) = delete;
  ReadGate& operator=(const ReadGate&) = delete;

  Transport* fallback = nullptr;  // set once, before any channel exists
  std::shared_ptr<Settings> settings;  // likewise
  absl::Mutex mu;
  // State below is protected by mu.
  int reserved ABSL_GUARDED_BY(mu) = 0;
  // The reservations (Transport::reserve_reading) of each thread that
  // holds some, which Lend gives back for the thread's wait.
  std::map<std::thread::id, int> reserved_by ABSL_GUARDED_BY(mu);
  // Their sum, read without mu: a thread that holds none sees it zero or
  // others' (its own changes are ordered before its reads), so a wait with
  // nothing to lend takes no lock.
  std::atomic<int> reserved_by_threads{0};
  // Moves when a role is let go or a reply has been handled.
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  // The threads in drive_same_host (a nested drive counts once), each with
  // the eventfd a reply handled anywhere (either transport) writes to wake
  // it to look at its done().
  struct Driver {
    std::thread::id thread;
    int wake_fd = -1;
    int depth = 0;
  };
  std::vector<Driver> drivers ABSL_GUARDED_BY(mu);
  std::vector<int> spare_fds ABSL_GUARDED_BY(mu);  // of drivers that left
  // All but the calling thread's: a driver that handled the reply itself
  // looks at its done() before it waits again.
  void wake_drivers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  std::vector<std::weak_ptr<DrivenChannel>> channels ABSL_GUARDED_BY(mu);
};

// Reads the same-host channels whose role is free (or held by this thread
// further up) until done() or `deadline`.
void drive_same_host(const std::shared_ptr<ReadGate>& gate, const std::function<bool()>& done,
                     absl::Time deadline);

// For the scope of a wait on one kind of channel: gives the calling
// thread's reservations of the other kind back, and takes them again at
// the end.
class Lend {
 public:
  Lend(ReadGate* gate, bool same_host_side) : gate_(gate), same_host_side_(same_host_side) {
    if (gate->reserved_by_threads.load(std::memory_order_relaxed) == 0) return;
    {
      absl::MutexLock lock(&gate->mu);
      auto it = gate->reserved_by.find(std::this_thread::get_id());
      n_ = it == gate->reserved_by.end() ? 0 : it->second;
    }
    for (int i = 0; i < n_; ++i) release();
  }
  ~Lend() {
    for (int i = 0; i < n_; ++i) reserve();
  }
  Lend(const Lend&) = delete;
  Lend& operator=(const Lend&) = delete;

 private:
  void release() {
    if (same_host_side_) {
      absl::MutexLock lock(&gate_->mu);
      --gate_->reserved;
    } else {
      gate_->fallback->release_reading();
    }
  }
  void reserve() {
    if (same_host_side_) {
      absl::MutexLock lock(&gate_->mu);
      ++gate_->reserved;
    } else {
      gate_->fallback->reserve_reading();
    }
  }
  ReadGate* const gate_;
  const bool same_host_side_;  // lends the same-host reservations (a gRPC wait)
  int n_ = 0;
};

}  // namespace ddprpc::rpc::transport::same_host
