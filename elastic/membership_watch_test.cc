#include "elastic/membership_watch.h"

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/registry.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "tests/multiprocess.h"
#include "tests/rpc_store.h"

namespace ddprpc::elastic {
namespace {

namespace mp = ddprpc::testing;

// A worker killed in the middle of a call is removed from the membership by
// the worker that called it, and a worker that never talked to it learns of
// it from the store, within seconds; the survivors agree on the epoch.
MULTIPROCESS_TEST(MembershipWatchTest, SurvivorsLearnOfAKilledWorker, 3) {
  rpc::register_function("die_now", [](int64_t) -> int64_t { mp::die_abruptly(); });
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  absl::StatusOr<std::shared_ptr<MembershipWatch>> watch =
      MembershipWatch::start(mp::connect_rpc_store(), {"worker0", "worker1", "worker2"});
  ASSERT_TRUE(watch.ok()) << watch.status();
  if (mp::rank() == 2) {
    absl::SleepFor(absl::Seconds(60));  // until worker0's call kills it
    ADD_FAILURE() << "worker2 was never called";
    return;
  }
  const absl::Time start = absl::Now();
  if (mp::rank() == 0) {
    auto call = rpc::rpc_async<int64_t>("worker2", "die_now", 0);
    ASSERT_TRUE(call.wait_for(absl::Seconds(30)));
    EXPECT_TRUE(call.has_error());
  }
  absl::StatusOr<rpc::Membership> next = (*watch)->await_change(1, absl::Seconds(30));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->epoch, 2) << next->encode();
  EXPECT_EQ(next->members, (std::vector<std::string>{"worker0", "worker1"}));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  if (mp::rank() == 0) {
    // Its own thread removed worker2 (the hook queued it); no one else did.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while ((*watch)->removals().empty() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ((*watch)->removals(), std::vector<std::string>{"worker2"});
  } else {
    EXPECT_TRUE((*watch)->removals().empty());
  }
  // Every survivor sees the same record.
  EXPECT_EQ((*watch)->current()->encode(), next->encode());
  watch->reset();
  EXPECT_FALSE(rpc::shutdown());  // worker2 is gone
}

// A worker removed once, then admitted again, is removed again when it is
// lost again (the watch does not remember it as gone for good).
TEST(MembershipWatchTest, AWorkerLostAgainAfterRejoiningIsRemovedAgain) {
  if (mp::is_worker()) return;
  auto server = rpc::StoreServer::start("127.0.0.1", 0, rpc::Security{});
  auto store = std::make_shared<rpc::Store>("127.0.0.1", server->port(), absl::Seconds(30),
                                            rpc::Security{});
  absl::StatusOr<std::shared_ptr<MembershipWatch>> watch =
      MembershipWatch::start(store, {"a", "b"});
  ASSERT_TRUE(watch.ok()) << watch.status();
  (*watch)->report_lost("b");
  absl::StatusOr<rpc::Membership> m = (*watch)->await_change(1, absl::Seconds(20));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->members, std::vector<std::string>{"a"});
  ASSERT_TRUE((*watch)->request_join("b").ok());
  m = (*watch)->admit_joining();
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->is_member("b")) << m->encode();
  const int64_t back = m->epoch;
  (*watch)->report_lost("b");
  m = (*watch)->await_change(back, absl::Seconds(20));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->members, std::vector<std::string>{"a"}) << m->encode();
  watch->reset();
}

}  // namespace
}  // namespace ddprpc::elastic
