// The pulling side of the bulk path: a worker's connections to one
// lender's listener, over which lent tensors are read straight into the
// tensors that receive them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/transport/internal/bulk_wire.h"

namespace ddprpc::rpc::transport::bulk {

struct PullerOptions {
  int self = -1;     // this worker, proven to the lender
  int lender = -1;   // the worker that lent
  std::string endpoint;  // its Listener, host:port
  std::string token;     // the job's token; empty: no proof
  int streams = 3;       // connections a large pull is spread over
  absl::Duration connect_timeout = absl::Seconds(10);
  absl::Duration silence = absl::Seconds(30);  // a pull that stalls this long fails
  // However slowly bytes come, a pull fails after silence + its bytes at
  // this rate.
  double min_bytes_per_second = kMinBytesPerSecond;
};

// Thread-safe; pulls from one lender run one at a time.
class Puller {
 public:
  explicit Puller(PullerOptions options) : options_(std::move(options)) {}
  ~Puller();
  Puller(const Puller&) = delete;
  Puller& operator=(const Puller&) = delete;

  // Reads the `nbytes` bytes of lend `id` into `dst`. A pull is cut into
  // ranges of at least 256 KiB, one per connection (up to `streams`), read
  // at once (a thread each beyond the first). An error (naming the
  // lender) closes the connections; the next pull opens new ones.
  absl::Status pull(uint64_t id, void* dst, uint64_t nbytes);

  // Tells the lender that lend `id` arrived otherwise (pushed): it may let
  // it go. Opens a connection if none is open; failing, the lend expires.
  void release(uint64_t id);

  // Ends the pull that runs now (its reads return at once) and fails every
  // later one (kCancelled). Any thread.
  void abort();

 private:
  absl::Status connect_locked(size_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status open_one(int* fd);
  void close_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void release_locked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status pull_range(int fd, uint64_t id, uint64_t offset, uint64_t length, char* dst,
                          absl::Time deadline);

  const PullerOptions options_;
  absl::Mutex mu_;
  // State below is protected by mu_.
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);

  absl::Mutex abort_mu_;  // taken after mu_, never before
  // State below is protected by abort_mu_.
  bool aborted_ ABSL_GUARDED_BY(abort_mu_) = false;
  // The connections of the pull that runs now (open until it clears them).
  std::vector<int> active_ ABSL_GUARDED_BY(abort_mu_);
  Interrupt interrupt_;  // fired by abort(): a connect in progress ends
};

}  // namespace ddprpc::rpc::transport::bulk
