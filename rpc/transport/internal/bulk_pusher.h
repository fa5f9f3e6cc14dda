// The lending side of pushes on the bulk path: a worker's connections to
// one receiver's listener, over which a lent tensor's bytes start moving
// as it is lent, before the frame that names it arrives.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {

struct PusherOptions {
  int self = -1;          // this worker, proven to the receiver
  int receiver = -1;      // the worker lent to
  std::string endpoint;   // its Listener, host:port
  std::string token;      // the job's token; empty: no proof
  int streams = 3;        // connections a tensor is pushed over
  absl::Duration connect_timeout = absl::Seconds(10);
  absl::Duration silence = absl::Seconds(30);  // a push that stalls this long fails
};

// Thread-safe. A thread per connection; none until the first push.
class Pusher {
 public:
  explicit Pusher(PusherOptions options);
  ~Pusher();  // abort(), then joins its threads
  Pusher(const Pusher&) = delete;
  Pusher& operator=(const Pusher&) = delete;

  // Starts pushing lend `id`, `tensor` (contiguous, CPU; kept until its
  // bytes are written), when every connection is open and idle: the number
  // of ranges it is pushed in (the frame says so, TensorMeta.pushed).
  // Otherwise 0, and the tensor is to be pulled; the first call opens the
  // connections in the background. Never waits on the network.
  uint32_t push(uint64_t id, const at::Tensor& tensor);
  // The bytes of the pushes made since the last call start moving (once
  // the frame that names them is on its way); or, with `cancel`, those
  // pushes are dropped (the frame was not sent).
  void start(bool cancel = false);

  // Ends the pushes under way and every later one. Any thread.
  void abort();

 private:
  struct Slot {
    int fd = -1;
    bool busy = false;
    bool started = false;
    // Signalled when its push starts or the pusher stops (a condition per
    // slot: the slots' threads start at once, not one after another).
    std::unique_ptr<absl::CondVar> wake = std::make_unique<absl::CondVar>();
    at::Tensor tensor;
    c10::Storage storage;  // the tensor's when pushed
    uint64_t first = 0;    // of the tensor's bytes in `storage`
    uint64_t nbytes = 0;   // the tensor's
    uint64_t id = 0;
    uint32_t index = 0;
    uint32_t ranges = 0;
    std::thread thread;
  };
  void connect_all();
  void run(size_t slot);
  int open_one(std::string* error);
  void fail_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PusherOptions options_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool connecting_ ABSL_GUARDED_BY(mu_) = false;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;  // every slot's connection is open
  absl::Time retry_after_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int failures_ ABSL_GUARDED_BY(mu_) = 0;  // connections failed in a row
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::thread connector_;
  Interrupt interrupt_;  // fired by abort(): a connect in progress ends
};

}  // namespace ddprpc::rpc::transport::bulk
