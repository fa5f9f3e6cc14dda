#include "rpc/core/internal/thread_policy.h"

#include <sched.h>

namespace ddprpc::rpc::internal {

void apply_thread_policy(bool batch) {
  if (!batch) return;
  const sched_param param{};  // priority 0, the only one SCHED_BATCH takes
  (void)sched_setscheduler(0, SCHED_BATCH, &param);
}

}  // namespace ddprpc::rpc::internal
