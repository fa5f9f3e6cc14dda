#include "rpc/transport/spin_budget.h"

#include <sched.h>

#include <algorithm>

namespace ddprpc::rpc::transport {

int64_t spin_ns(absl::Duration max_spin) {
  return std::clamp<int64_t>(absl::ToInt64Nanoseconds(max_spin), 0, kMaxSpinUs * 1000);
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace ddprpc::rpc::transport
