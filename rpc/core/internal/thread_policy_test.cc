#include "rpc/core/internal/thread_policy.h"

#include <sched.h>

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

Policies run_thread(bool batch) {
  Policies p;
  std::thread([&p, batch] {
    apply_thread_policy(batch);
    p.runtime = sched_getscheduler(0);
    std::thread([&p] { p.child = sched_getscheduler(0); }).join();
  }).join();
  return p;
}

TEST(ThreadPolicy, RuntimeThreadsRunAsBatchAndTheirThreadsInheritIt) {
  const Policies p = run_thread(true);
  EXPECT_EQ(p.runtime, SCHED_BATCH);
  EXPECT_EQ(p.child, SCHED_BATCH);
  // The thread that started it is not changed.
  EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);
}

TEST(ThreadPolicy, SwitchedOffLeavesThreadsAlone) {
  const Policies p = run_thread(false);
  EXPECT_EQ(p.runtime, SCHED_OTHER);
  EXPECT_EQ(p.child, SCHED_OTHER);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
