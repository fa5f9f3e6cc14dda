// The threads that pull lent tensors, off the threads that read frames: a
// frame that names lent tensors is queued here by its reader, which goes
// on reading; a pool thread pulls the tensors and then delivers the frame.
//
// Per peer, one pull runs at a time (its connections carry one pull's
// ranges at once) and the rest wait their turn in order; peers take turns.
// A peer stops being served for its next pull as soon as its last one has
// its bytes: the delivery that follows holds a thread, not the peer.
// Threads start as queued work needs them, up to max_threads, and leave
// after idle_timeout without work.
//
// A delivery that blocks (a reply's callbacks waiting for another call,
// whose reply may itself wait here to be pulled) holds its thread, but
// not a place among the max_threads that pull: while deliveries run, up
// to max_delivering more threads may start, so that pulls go on. Past
// that, pulls wait until a delivery returns.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ddprpc::rpc::transport::bulk {

struct PullPoolOptions {
  int max_threads = 16;  // threads pulling, or free to
  absl::Duration idle_timeout = absl::Seconds(10);
  int max_delivering = 64;  // threads delivering beyond those
};

class PullPool {
 public:
  explicit PullPool(PullPoolOptions options = {});
  // stop(), then waits for the threads to leave (not for itself, when a
  // pool thread destroys the pool).
  ~PullPool();
  PullPool(const PullPool&) = delete;
  PullPool& operator=(const PullPool&) = delete;

  // Queues `pull` for `peer`'s turn, then `deliver` on the same thread.
  // Neither may throw (one that does is logged and its job ends). False,
  // with nothing queued, after stop().
  bool submit(int peer, std::function<void()> pull, std::function<void()> deliver);

  // Queued jobs are dropped (destroyed unrun); running ones finish.
  void stop();
  // After stop(): returns once every thread but the calling one has left.
  void wait();

  // Threads running now (for tests).
  int threads() const;

 private:
  struct Core;
  static void run(std::shared_ptr<Core> core);
  const std::shared_ptr<Core> core_;
};

}  // namespace ddprpc::rpc::transport::bulk
