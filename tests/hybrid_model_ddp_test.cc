// HybridModel training as ddp_rpc runs it (tables on a parameter server by
// RRef, the dense part under DDP inside distributed autograd, the
// distributed optimizer): the trainers' dense parameters stay bit-identical
// step after step, and without DDP they drift apart (so the check can fail).
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "gtest/gtest.h"
#include "models/hybrid_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
#include "tests/multiprocess.h"
#include "tests/rpc_store.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace dist_autograd = ddprpc::dist_autograd;
namespace ddp = ddprpc::ddp;
namespace models = ddprpc::models;

namespace {

constexpr int kTrainers = 2;
constexpr int64_t kRows = 50, kDim = 8, kSteps = 5;

// This trainer's dense parameters after training, flattened.
at::Tensor g_dense;
at::Tensor dense_parameters() { return g_dense; }
DDPRPC_REGISTER_FUNCTION(dense_parameters);

// Trains kSteps batches (rank-dependent data) with or without DDP; leaves the
// flattened dense parameters in g_dense.
void train(bool with_ddp, const std::string& tag) {
  const int rank = mp::rank();
  std::vector<rpc::RRef<models::EmbeddingTable>> tables = {
      rpc::remote<models::EmbeddingTable>("worker2", kRows, kDim)};
  at::manual_seed(42);  // the same initial dense part on both trainers
  models::HybridModel model(tables, kDim);
  std::shared_ptr<ddp::ProcessGroup> group;
  std::unique_ptr<ddp::DistributedDataParallel> averaged;
  if (with_ddp) {
    ddp::ProcessGroupOptions options;
    options.same_host_allreduce = !mp::network_paths_only();
    options.timeout = absl::Seconds(30);
    group = ddp::make_gloo_group(mp::connect_rpc_store(), "test/" + tag + "/", rank, kTrainers,
                                 options);
    averaged = std::make_unique<ddp::DistributedDataParallel>(model.dense().ptr(), group);
  }
  ddprpc::optim::DistributedOptimizer optimizer("sgd", {{"lr", 0.1}}, model.parameter_rrefs());
  at::manual_seed(1000 + rank);  // each trainer its own batches
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor indices = at::randint(kRows, {20}, at::kLong);
    at::Tensor offsets = at::arange(0, 20, 4, at::kLong);
    at::Tensor targets = at::randint(8, {5}, at::kLong);
    dist_autograd::Context context;
    at::Tensor loss = at::cross_entropy_loss(model.forward(indices, offsets), targets);
    dist_autograd::backward(context.id(), {loss});
    optimizer.step(context.id());
  }
  std::vector<at::Tensor> flat;
  for (const auto& p : model.dense()->parameters()) flat.push_back(p.detach().reshape({-1}));
  g_dense = at::cat(flat).clone();
}

// The other trainer's dense parameters once both have finished `tag`.
at::Tensor others(rpc::Store& store, const std::string& tag) {
  const int rank = mp::rank();
  store.set(absl::StrCat("test/", tag, "/done/", rank), "1");
  store.wait({absl::StrCat("test/", tag, "/done/0"), absl::StrCat("test/", tag, "/done/1")},
             absl::Seconds(60));
  at::Tensor other = rpc::rpc_sync<at::Tensor>(absl::StrCat("worker", 1 - rank), "dense_parameters");
  // Both have read before either goes on and replaces g_dense.
  store.set(absl::StrCat("test/", tag, "/read/", rank), "1");
  store.wait({absl::StrCat("test/", tag, "/read/0"), absl::StrCat("test/", tag, "/read/1")},
             absl::Seconds(60));
  return other;
}

MULTIPROCESS_TEST(HybridModelDdpTest, DenseReplicasStayIdenticalOnlyWithDdp, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() < kTrainers) {
    auto store = mp::connect_rpc_store();
    train(/*with_ddp=*/true, "ddp");
    at::Tensor other = others(*store, "ddp");
    EXPECT_TRUE(at::equal(other, g_dense))
        << "dense parameters differ by up to " << (other - g_dense).abs().max().item<double>();
    train(/*with_ddp=*/false, "local");
    other = others(*store, "local");
    EXPECT_FALSE(at::allclose(other, g_dense)) << "without DDP the replicas should drift apart";
  }
  rpc::shutdown();
}

}  // namespace
