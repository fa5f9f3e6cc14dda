#include "rpc/internal/thread_policy.h"

#include <sched.h>
#include <stdlib.h>

#include <thread>

#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

// The policy of a new thread that applies the runtime's policy, and of a
// thread that it starts.
struct Policies {
  int runtime = -1;
  int child = -1;
};

Policies run_thread() {
  Policies p;
  std::thread([&p] {
    apply_thread_policy();
    p.runtime = sched_getscheduler(0);
    std::thread([&p] { p.child = sched_getscheduler(0); }).join();
  }).join();
  return p;
}

TEST(ThreadPolicy, RuntimeThreadsRunAsBatchAndTheirThreadsInheritIt) {
  unsetenv(kSchedBatchEnv);
  set_batch_scheduling(true);
  ASSERT_TRUE(batch_scheduling());
  const Policies p = run_thread();
  EXPECT_EQ(p.runtime, SCHED_BATCH);
  EXPECT_EQ(p.child, SCHED_BATCH);
  // The thread that set it is not changed.
  EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);
}

TEST(ThreadPolicy, SwitchedOffLeavesThreadsAlone) {
  unsetenv(kSchedBatchEnv);
  set_batch_scheduling(false);
  EXPECT_FALSE(batch_scheduling());
  EXPECT_EQ(run_thread().runtime, SCHED_OTHER);
  set_batch_scheduling(true);
}

TEST(ThreadPolicy, EnvironmentSwitchWins) {
  setenv(kSchedBatchEnv, "0", 1);
  set_batch_scheduling(true);
  EXPECT_FALSE(batch_scheduling());
  EXPECT_EQ(run_thread().runtime, SCHED_OTHER);
  setenv(kSchedBatchEnv, "1", 1);
  set_batch_scheduling(true);
  EXPECT_TRUE(batch_scheduling());
  EXPECT_EQ(run_thread().runtime, SCHED_BATCH);
  unsetenv(kSchedBatchEnv);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
