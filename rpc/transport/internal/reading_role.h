// The I/O core both transports' servers share: the reading role, the
// threads that take turns holding it, and the watchdog that takes it from a
// holder stuck on one message.
//
// A server's input (gRPC's completion queue, the same-host transport's epoll
// set) is read by one thread at a time, the role holder, which runs what it
// reads inline: a request reaches its function with no thread hop, and one
// thread wakes per message. The other threads wait for the role. When the
// holder has been on one message too long (it blocks, or waits for a later
// request of the same caller), the server's watchdog takes the role from it
// (ReadingRole::hand_off): the holder finishes that message, finds that it
// no longer holds the role (held_by), and waits for it again; a waiting
// thread, started if none waits, holds it from then on.
//
// Both classes keep their state under the server's own mutex, given at
// construction, so that the server changes its state and the role's in one
// critical section. Each method says whether it is called with that mutex
// held.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ddprpc::rpc::internal {

class ReadingRole {
 public:
  // No thread holds the role. Threads are numbered from 1.
  static constexpr int64_t kNobody = 0;

  struct Options {
    const char* name = "rpc transport";  // starts the log lines
    bool batch_scheduling = false;       // apply_thread_policy of each thread
    // Threads waiting for the role beyond this many leave; -1: none leave.
    int max_idle = -1;
  };
  // Holds the role as thread `me`; returns once `me` lost it (held_by is
  // false), or when the thread should leave (the server stops).
  using Hold = std::function<void(int64_t me)>;

  ReadingRole(absl::Mutex* mu, Options options, Hold hold);
  // join() must have returned (if a thread was ever started).
  ~ReadingRole();

  ReadingRole(const ReadingRole&) = delete;
  ReadingRole& operator=(const ReadingRole&) = delete;

  // Starts a thread that waits for the role and holds it whenever it gets
  // it. False when none can start (logged), or after stop(). With the
  // mutex held.
  bool add_thread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);

  // Whether thread `me` holds the role. With the mutex held.
  bool held_by(int64_t me) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) { return holder_ == me; }

  // Takes the role from its holder and frees it for a waiting thread,
  // starting one if none waits. With the mutex held.
  void hand_off() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);

  // Running threads, and those of them not waiting for the role. With the
  // mutex held.
  int threads() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) { return running_; }
  int busy_threads() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) { return running_ - idle_; }

  // Waiting threads leave and none starts; a holder leaves once its Hold
  // returns. With the mutex held.
  void stop() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);
  bool stopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) { return stop_; }

  // After stop(): waits until every thread has left and joins them.
  // Without the mutex held.
  void join() ABSL_LOCKS_EXCLUDED(*mu_);

 private:
  void run(int64_t me);
  // Takes the threads that have left out of threads_, for the caller to
  // join once it has let the mutex go (their exit may run thread-local
  // destructors of other code, which must not wait on a held mutex).
  std::vector<std::thread> take_left() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);

  absl::Mutex* const mu_;
  const Options options_;
  const Hold hold_;
  // State below is protected by *mu_.
  std::map<int64_t, std::thread> threads_ ABSL_GUARDED_BY(*mu_);
  std::vector<int64_t> left_ ABSL_GUARDED_BY(*mu_);  // threads that returned from run()
  int64_t next_id_ ABSL_GUARDED_BY(*mu_) = kNobody + 1;
  int running_ ABSL_GUARDED_BY(*mu_) = 0;  // threads in run()
  int idle_ ABSL_GUARDED_BY(*mu_) = 0;     // threads waiting for the role
  int64_t holder_ ABSL_GUARDED_BY(*mu_) = kNobody;  // kNobody: the role is free
  bool stop_ ABSL_GUARDED_BY(*mu_) = false;
};

// A thread that looks at a server's role holder now and then and parks
// while there is nothing to look at. `look` runs with the server's mutex
// held (it may release it for a while, as long as it holds it again when it
// returns) and says how long to wait before the next look (at least
// kMinWait: the wait lets the mutex go), or absl::InfiniteDuration() to
// park until wake(); after a wake the next look comes `after_wake` later.
//
// Parking races with work that starts meanwhile: the watchdog raises its
// parked flag before every look, so work marked (under the mutex) after a
// look that found none sees the flag, and its wake() unparks the watchdog.
class RoleWatchdog {
 public:
  using Look = std::function<absl::Duration()>;
  static constexpr absl::Duration kMinWait = absl::Milliseconds(1);

  RoleWatchdog(absl::Mutex* mu, absl::Duration after_wake, Look look);
  // stop() must have been called (if start() was).
  ~RoleWatchdog();

  // Starts the thread; throws std::system_error when it cannot.
  void start(bool batch_scheduling);

  // Unparks the watchdog; cheap when it is not parked. Called after the
  // work it should look at was marked under the mutex, without the mutex
  // held.
  void wake() ABSL_LOCKS_EXCLUDED(*mu_);
  // The same, with the mutex held.
  void wake_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_) {
    parked_.store(false);
  }

  // Stops and joins the thread. Without the mutex held.
  void stop() ABSL_LOCKS_EXCLUDED(*mu_);

 private:
  void loop();

  absl::Mutex* const mu_;
  const absl::Duration after_wake_;
  const Look look_;
  std::thread thread_;
  // Written with *mu_ held; read without it by wake().
  std::atomic<bool> parked_{false};
  bool stop_ ABSL_GUARDED_BY(*mu_) = false;
};

}  // namespace ddprpc::rpc::internal
