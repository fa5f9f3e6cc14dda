#include "rpc/internal/thread_policy.h"

#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ddprpc::rpc::internal {
namespace {

bool env_allows() {
  const char* v = std::getenv(kSchedBatchEnv);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool>& setting() {
  static std::atomic<bool> on{env_allows()};
  return on;
}

}  // namespace

void set_batch_scheduling(bool on) { setting().store(on && env_allows()); }

bool batch_scheduling() { return setting().load(); }

void apply_thread_policy() {
  if (!batch_scheduling()) return;
  const sched_param param{};  // priority 0, the only one SCHED_BATCH takes
  (void)sched_setscheduler(0, SCHED_BATCH, &param);
}

}  // namespace ddprpc::rpc::internal
