// Who reads the replies of a same-host transport's channels (ReadGate),
// and the waits of callers that read their own replies (drive_same_host).
#pragma once

#include <cstdint>
#include <functional>
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
  Transport* fallback = nullptr;  // set once, before any channel exists
  std::shared_ptr<Settings> settings;  // likewise
  absl::Mutex mu;
  // State below is protected by mu.
  int reserved ABSL_GUARDED_BY(mu) = 0;
  // Moves when a role is let go or a reply has been handled.
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  // Eventfds of the threads in drive_same_host: a reply handled anywhere
  // (either transport) wakes them to look at their done().
  std::vector<int> driver_fds ABSL_GUARDED_BY(mu);
  // All but the calling thread's: a driver that handled the reply itself
  // looks at its done() before it waits again.
  void wake_drivers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  std::vector<std::weak_ptr<DrivenChannel>> channels ABSL_GUARDED_BY(mu);
};

// Reads the same-host channels whose role is free (or held by this thread
// further up) until done() or `deadline`.
void drive_same_host(const std::shared_ptr<ReadGate>& gate, const std::function<bool()>& done,
                     absl::Time deadline);

// The reservations this thread holds through `gate` (Transport::
// reserve_reading), counted per thread.
int& reserved_here(const ReadGate* gate);

// For the scope of a wait on one kind of channel: gives this thread's
// reservations of the other kind back, and takes them again at the end.
class Lend {
 public:
  Lend(ReadGate* gate, bool same_host_side) : gate_(gate), same_host_side_(same_host_side) {
    n_ = reserved_here(gate);
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
