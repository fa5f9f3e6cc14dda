// How long a waiting thread may look before it sleeps, for every busy wait
// of the job on one host (the same-host transport's polls, the shared-memory
// allreduce's barriers).
//
// The budget is DDPRPC_SPIN_US microseconds (default kDefaultMaxSpinUs, at
// most kMaxSpinUs; 0 turns spinning off; a value that does not parse keeps
// the default), read once per process. Spinning pays only while the
// processes that wait on each other have a CPU each: callers compare their
// group with usable_cpus().
#pragma once

#include <cstdint>

namespace ddprpc::rpc::transport {

inline constexpr char kSpinEnv[] = "DDPRPC_SPIN_US";
inline constexpr int64_t kDefaultMaxSpinUs = 50;
inline constexpr int64_t kMaxSpinUs = 10000;

// The process's budget, in nanoseconds.
int64_t max_spin_ns();

// CPUs this process may run on (at least 1).
int usable_cpus();

}  // namespace ddprpc::rpc::transport
