// The receiving side of pushes on the bulk path: tensors that frames say
// are being pushed, registered as each frame is checked, and taken by the
// push connections that carry their bytes.
//
// A claim is made for a pushed tensor once its frame has been parsed and
// checked: its bytes are counted against the peer's bounds first (reserve),
// then the tensor is allocated and the claim is ready. A push connection's
// range finds its claim (waiting a while for the frame, which may come after
// the bytes), checks that the range is one the claim expects and not taken
// yet, and reads the bytes into the claim's tensor. The frame's delivery
// waits for every range; if one does not start in time, or fails, it takes
// the claim over (no range starts after that), waits for the ranges being
// read, and pulls the tensor instead. So a tensor is written by pushes or by
// a pull, never by both at once, and its memory (held by the claim) outlives
// every write into it.
//
// What a peer can make this side hold is bounded: claims exist only for
// checked frames, at most max_claims_per_peer and max_bytes_per_peer per
// peer, counted before their memory is allocated, and each is counted
// until its frame's delivery is done with it or the frame is dropped
// (whoever reserved a claim ends it: await or drop). A range may only land
// in a claim of the worker its connection proved to be.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ddprpc::rpc::transport::bulk {

struct ClaimLimits {
  int max_claims_per_peer = 1024;
  int64_t max_bytes_per_peer = int64_t{1} << 30;
};

// Thread-safe.
class ClaimTable {
 public:
  struct Claim;

  explicit ClaimTable(ClaimLimits limits = {}) : limits_(limits) {}

  // Counts `nbytes` of tensor `id`, pushed by `peer` over `ranges`
  // connections (at most kMaxPushRanges), against the peer's bounds, before
  // its memory is allocated. Null when the peer holds its bound of claims or
  // bytes, or already has one of that id (the tensor is then pulled).
  // Ranges wait for ready(); the caller ends the claim with await() or
  // drop().
  std::shared_ptr<Claim> reserve(int peer, uint64_t id, uint64_t nbytes, uint32_t ranges);
  // The reserved claim's bytes go into `tensor` (contiguous, CPU, of the
  // claim's bytes): its ranges may start. False (the claim dropped) when
  // the sizes differ.
  bool ready(const std::shared_ptr<Claim>& claim, at::Tensor tensor);

  // A push connection's range: waits up to `wait` for the claim of (`peer`,
  // `id`), then checks the range against it. On success the bytes go to
  // [*dst, *dst + *length), and end_range() must follow.
  absl::Status begin_range(int peer, uint64_t id, uint64_t total, uint32_t ranges,
                           uint32_t index, absl::Duration wait, std::shared_ptr<Claim>* claim,
                           char** dst, uint64_t* length);
  void end_range(const std::shared_ptr<Claim>& claim, bool ok);

  // The delivery's side: true once every range has arrived. False when a
  // range did not start within `start_wait` of the claim, failed, or did
  // not finish by `deadline`; the claim is then taken over, and this
  // returns once no range is being read into it (the caller pulls the
  // tensor). Either way the claim leaves the table.
  bool await(const std::shared_ptr<Claim>& claim, absl::Duration start_wait,
             absl::Time deadline);

  // Pushes waiting for their claims, and later ones, fail at once.
  void close();

  // Ends the claims of a frame that will not be delivered.
  void drop(const std::shared_ptr<Claim>& claim);

  size_t size();

 private:
  void erase_locked(const std::shared_ptr<Claim>& claim) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClaimLimits limits_;
  absl::Mutex mu_;
  // State below is protected by mu_ (a claim's fields too).
  std::map<std::pair<int, uint64_t>, std::shared_ptr<Claim>> claims_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::pair<int, int64_t>> per_peer_ ABSL_GUARDED_BY(mu_);  // claims, bytes
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

struct ClaimTable::Claim {
  int peer = -1;
  uint64_t id = 0;
  at::Tensor tensor;
  uint64_t nbytes = 0;
  uint32_t ranges = 0;
  absl::Time made;  // when its tensor was set (ranges may start from then)
  std::vector<bool> started;
  int active = 0;    // ranges being read now
  uint32_t done = 0;  // ranges read whole
  bool failed = false;
  bool listed = true;  // in claims_: ranges may start (false once taken over or dropped)
};

}  // namespace ddprpc::rpc::transport::bulk
