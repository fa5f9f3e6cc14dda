#include "rpc/transport/spin_budget.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace ddprpc::rpc::transport {

int64_t max_spin_ns() {
  static const int64_t max_ns = [] {
    const char* v = std::getenv(kSpinEnv);
    if (v == nullptr || *v == '\0') return kDefaultMaxSpinUs * 1000;
    char* end = nullptr;
    const long long us = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || us < 0) return kDefaultMaxSpinUs * 1000;
    return static_cast<int64_t>(std::min<long long>(us, kMaxSpinUs)) * 1000;
  }();
  return max_ns;
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace ddprpc::rpc::transport
