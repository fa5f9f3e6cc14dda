// How long a waiting thread may look before it sleeps (the same-host
// transport's polls, the gRPC transport's completion queues, the
// shared-memory allreduce's barriers), and the CPUs
// this process may use. Spinning is the program's choice
// (TransportOptions::max_spin, ddp::ProcessGroupOptions::max_spin): off by
// default, because it burns CPU time in someone else's process. It pays
// only while the processes that wait on each other have a CPU each:
// callers compare their group with usable_cpus().
#pragma once

#include <cstdint>

#include "absl/time/time.h"

namespace ddprpc::rpc::transport {

// What the benchmarks ask for, and the most any option takes.
inline constexpr int64_t kSuggestedMaxSpinUs = 50;
inline constexpr int64_t kMaxSpinUs = 10000;

// `max_spin` in nanoseconds, clamped to [0, kMaxSpinUs].
int64_t spin_ns(absl::Duration max_spin);

// CPUs this process may run on (at least 1).
int usable_cpus();

}  // namespace ddprpc::rpc::transport
