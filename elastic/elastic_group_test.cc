#include "elastic/elastic_group.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/full.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "tests/multiprocess.h"
#include "tests/rpc_store.h"

namespace ddprpc::elastic {
namespace {

namespace mp = ddprpc::testing;

ElasticGroup::Options options() {
  ElasticGroup::Options o;
  o.role = "worker";
  o.group.timeout = absl::Seconds(10);
  o.group.same_host_allreduce = !mp::network_paths_only();
  o.ping_timeout = absl::Seconds(3);
  o.change_timeout = absl::Seconds(30);
  return o;
}

// Three replicas step a parameter by the group's averaged gradient; one
// dies before its fifth step. The survivors' allreduce fails, they recover
// into epoch 2 as a group of two, drop the step, and finish the others with
// identical parameters.
MULTIPROCESS_TEST(ElasticGroupTest, SurvivorsReformAndTrainOn, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  std::shared_ptr<rpc::Store> store = mp::connect_rpc_store();
  absl::StatusOr<std::shared_ptr<MembershipWatch>> watch =
      MembershipWatch::start(store, {"worker0", "worker1", "worker2"});
  ASSERT_TRUE(watch.ok()) << watch.status();
  ElasticGroup replicas(store, *watch, mp::worker_name(), options());
  EXPECT_EQ(replicas.group()->size(), 3);
  EXPECT_EQ(replicas.group()->rank(), mp::rank());
  EXPECT_EQ(replicas.epoch(), 1);

  // Each rank starts from different values; the first broadcast aligns them.
  at::Tensor w = at::full({4}, static_cast<double>(mp::rank()), at::kDouble);
  replicas.group()->broadcast({w}, 0)->wait(absl::Seconds(30));
  int done = 0, dropped = 0;
  absl::Duration recovery;
  for (int step = 0; step < 10; ++step) {
    if (mp::rank() == 2 && step == 4) mp::die_abruptly();
    at::Tensor grad = at::full({4}, 1.0 + mp::rank(), at::kDouble);
    try {
      replicas.group()->allreduce({grad}, ddp::ReduceOp::kAvg)->wait(absl::Seconds(30));
    } catch (const std::exception& e) {
      const absl::Time t0 = absl::Now();
      absl::StatusOr<int64_t> epoch = replicas.recover({w});
      recovery = absl::Now() - t0;
      ASSERT_TRUE(epoch.ok()) << epoch.status() << " after " << e.what();
      ++dropped;
      continue;
    }
    w -= 0.1 * grad;
    ++done;
  }
  EXPECT_EQ(dropped, 1);
  EXPECT_EQ(done, 9);
  EXPECT_EQ(replicas.epoch(), 2);
  EXPECT_EQ(replicas.group()->size(), 2);
  EXPECT_LT(recovery, absl::Seconds(20));
  std::cerr << "worker" << mp::rank() << ": recovered in " << recovery << "\n";
  // The survivors hold the same parameters: four steps of three replicas
  // (mean gradient 2), then five of two (mean 1.5).
  at::Tensor expected = at::full({4}, 0.0 - 0.1 * (4 * 2.0 + 5 * 1.5), at::kDouble);
  EXPECT_TRUE(at::allclose(w, expected)) << w;
  at::Tensor other = w.clone();
  replicas.group()->broadcast({other}, 1)->wait(absl::Seconds(30));
  EXPECT_TRUE(at::allclose(w, other));
  watch->reset();
  EXPECT_FALSE(rpc::shutdown());  // worker2 is gone
}

// A worker admitted and then lost before the members move on: every member
// forms the epoch they agreed on (the admission), not the newest one each
// would read on its own, and meets the others there.
MULTIPROCESS_TEST(ElasticGroupTest, AdvanceFormsTheEpochAgreedOnNotTheNewest, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  std::shared_ptr<rpc::Store> store = mp::connect_rpc_store();
  absl::StatusOr<std::shared_ptr<MembershipWatch>> watch =
      MembershipWatch::start(store, {"worker0", "worker1"});
  ASSERT_TRUE(watch.ok()) << watch.status();
  ElasticGroup replicas(store, *watch, mp::worker_name(), options());
  EXPECT_EQ(replicas.group()->size(), 2);
  if (mp::rank() == 0) {
    // worker7 asks to join (epoch 2), is admitted (3), and is lost (4).
    ASSERT_TRUE((*watch)->request_join("worker7").ok());
    absl::StatusOr<rpc::Membership> admitted = (*watch)->admit_joining();
    ASSERT_TRUE(admitted.ok()) << admitted.status();
    EXPECT_EQ(admitted->epoch, 3);
    ASSERT_TRUE((*watch)->remove("worker7").ok());
  }
  absl::StatusOr<rpc::Membership> now = (*watch)->await_change(3, absl::Seconds(20));
  ASSERT_TRUE(now.ok()) << now.status();
  ASSERT_EQ(now->epoch, 4);

  // Epoch 3 held worker7: forming it fails on both members, at the group's
  // timeout, and neither moves to epoch 4 on its own.
  absl::StatusOr<int64_t> with_lost = replicas.advance(3);
  EXPECT_FALSE(with_lost.ok());
  EXPECT_NE(with_lost.status().message().find("epoch 3 (3 members)"), std::string::npos)
      << with_lost.status();
  EXPECT_EQ(replicas.epoch(), 1);
  absl::StatusOr<int64_t> agreed = replicas.advance(4);
  ASSERT_TRUE(agreed.ok()) << agreed.status();
  EXPECT_EQ(*agreed, 4);
  EXPECT_EQ(replicas.members(), (std::vector<std::string>{"worker0", "worker1"}));
  at::Tensor x = at::full({3}, 1.0 + mp::rank(), at::kDouble);
  replicas.group()->allreduce({x}, ddp::ReduceOp::kSum)->wait(absl::Seconds(30));
  EXPECT_TRUE(at::allclose(x, at::full({3}, 3.0, at::kDouble))) << x;

  std::shared_ptr<ddp::ProcessGroup> same = replicas.group();
  EXPECT_EQ(*replicas.advance(4), 4);  // already there: the group stays
  EXPECT_EQ(replicas.group(), same);
  EXPECT_EQ(replicas.advance(2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(replicas.group(), same);
  watch->reset();
  rpc::shutdown();
}

}  // namespace
}  // namespace ddprpc::elastic
