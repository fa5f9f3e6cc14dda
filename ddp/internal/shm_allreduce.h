// Allreduce among the processes of one host through a shared-memory
// segment, for buffers of at most kMaxBytes: every rank copies its buffer
// into its slot, reduces its 1/n of the buffer across all slots (in rank
// order, so every rank gets the same bits), and copies every rank's reduced
// part out. Two barriers per call, on a futex in the segment: a rank that
// waits sleeps, after a short spin when the ranks fit this host's CPUs. Two
// sets of slots are used in turn, so a call's writes never meet the
// previous call's reads and no third barrier is needed.
//
// Rank 0 creates the segment under a random name (mode 0600, reserved in
// full, so that a small /dev/shm fails here and not with SIGBUS later) and
// hands the name to the others over the Gloo group, the job's own trust;
// it unlinks the name once every rank tried to open it. The segment is used
// only when every rank mapped it, read rank 0's nonce in it and can watch
// every peer's pid (so all are on this host): by all ranks alike, or by
// none (same_host_allreduce false on any rank opts the group out).
//
// A wait fails with std::runtime_error naming the ranks that did not
// arrive, when a rank exits, when a rank's object is destroyed without
// having failed (as a Gloo peer closing its connections) or when `timeout`
// passes; the object is unusable after a failure, as a Gloo context is.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "ddp/internal/same_host_common.h"

namespace gloo {
class Context;
}

namespace ddprpc::ddp::internal {

class ShmAllreduce {
 public:
  // Largest allreduce (bytes) it takes.
  static constexpr int64_t kMaxBytes = int64_t{1} << 20;
  // Largest group it serves: the segment, reserved in full, takes two
  // slots of kMaxBytes per rank (16 MiB for 8 ranks, 128 MiB for 64).
  static constexpr int kMaxRanks = 64;

  // Collective over `context` (every rank calls it, in the same order as
  // the group's other operations). nullptr when some rank cannot or, not
  // `willing`, will not take part. Barriers spin for up to `max_spin`
  // before they sleep while the group has a CPU per rank.
  static std::unique_ptr<ShmAllreduce> connect(const std::shared_ptr<gloo::Context>& context,
                                               absl::Duration timeout, bool willing,
                                               absl::Duration max_spin);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // Collective: `tensors` (contiguous, CPU, one dtype Gloo reduces, at most
  // kMaxBytes together; the same shapes on every rank) become the
  // reduction of every rank's. With `average` (a sum of float or double
  // tensors only, see can_average), every element is then divided by the
  // group's size, as a division after the call would. Not thread-safe: one
  // caller at a time (the group's operation thread).
  void run(const std::vector<at::Tensor>& tensors, Reduction op, bool average = false);
  static bool can_average(at::ScalarType type) {
    return type == at::kFloat || type == at::kDouble;
  }

  // Allreduces this process ran this way (for tests and reports).
  static int64_t runs();

 private:
  ShmAllreduce(int rank, int size, void* base, size_t bytes, std::vector<int64_t> pids,
               std::vector<int> pidfds, absl::Duration timeout, absl::Duration max_spin);
  char* slot(int set, int rank) const;
  void barrier(absl::Time deadline);
  // Waits until the barrier generation moves past `generation`.
  void await(uint32_t generation, absl::Time deadline);
  [[noreturn]] void fail(const std::string& why);

  const int rank_, size_;
  void* const base_;
  const size_t bytes_;
  const std::vector<int64_t> pids_;  // by rank
  const std::vector<int> pidfds_;    // by rank; readable once that rank exited (-1: self)
  const absl::Duration timeout_;
  // The host's spin budget (rpc/transport/spin_budget.h); zero unless the
  // group fits this host's CPUs.
  const absl::Duration spin_;
  uint64_t calls_ = 0;
  uint64_t barriers_ = 0;
  bool broken_ = false;
  std::vector<char> accumulator_;
};

}  // namespace ddprpc::ddp::internal
