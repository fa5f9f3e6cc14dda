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

}  // namespace
}  // namespace ddprpc::elastic
