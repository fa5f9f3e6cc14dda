// A program of another workspace using ddprpc target by target: two
// trainers, each looking up an embedding table that lives on the other one
// (rpc::remote, RRef), a dense stack under DDP (Gloo, rendezvous through
// the RPC store), distributed autograd and DistributedOptimizer. Started
// without RANK it launches itself twice (rpc::launch). Each trainer checks
// that its loss fell and that both trainers' dense parameters are equal
// after training (DDP averaged every step); exits non-zero otherwise.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "models/hybrid_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rendezvous/launch.h"
#include "rpc/rpc.h"

namespace rpc = ddprpc::rpc;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

constexpr int kWorld = 2;
constexpr int64_t kRows = 100, kDim = 16, kSteps = 30;

// This trainer's dense parameters, flattened (read by the other trainer).
at::Tensor g_dense;
at::Tensor dense_parameters() { return g_dense; }
DDPRPC_REGISTER_FUNCTION(dense_parameters);

// Trains and checks; every RRef is gone when it returns.
int train_and_check(int rank) {
  at::manual_seed(rank);
  // The table this trainer uses lives on the other trainer.
  std::vector<rpc::RRef<ddprpc::models::EmbeddingTable>> tables = {
      rpc::remote<ddprpc::models::EmbeddingTable>(absl::StrCat("trainer", 1 - rank), kRows,
                                                  kDim)};
  ddprpc::models::HybridModel model(tables, kDim);

  // DDP over both trainers; its process group meets through the RPC store.
  const std::string address = rpc::current_agent()->store().address();
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    std::fprintf(stderr, "unexpected store address %s\n", address.c_str());
    return 1;
  }
  auto store = std::make_shared<rpc::Store>(address.substr(0, colon), port, absl::Seconds(60));
  auto group = ddprpc::ddp::make_gloo_group(store, "consumer/ddp/", rank, kWorld);
  ddprpc::ddp::DistributedDataParallel ddp(model.dense().ptr(), group);
  ddprpc::optim::DistributedOptimizer optimizer("sgd", {{"lr", 0.05}}, model.parameter_rrefs());

  // A fixed batch per trainer: the loss must fall.
  at::Tensor indices = at::randint(kRows, {24}, at::kLong);
  at::Tensor offsets = at::arange(0, 24, 3, at::kLong);
  at::Tensor targets = at::randint(8, {8}, at::kLong);
  double first = 0, last = 0;
  for (int step = 0; step < kSteps; ++step) {
    dist_autograd::Context context;
    at::Tensor loss = at::cross_entropy_loss(model.forward(indices, offsets), targets);
    (step == 0 ? first : last) = loss.item<double>();
    dist_autograd::backward(context.id(), {loss});
    optimizer.step(context.id());
  }

  std::vector<at::Tensor> flat;
  for (const auto& p : model.dense()->parameters()) flat.push_back(p.detach().reshape({-1}));
  g_dense = at::cat(flat);
  // Both trainers have set g_dense before either asks for the other's.
  store->set(absl::StrCat("consumer/done/", rank), "1");
  store->wait({"consumer/done/0", "consumer/done/1"}, absl::Seconds(60));
  at::Tensor other =
      rpc::rpc_sync<at::Tensor>(absl::StrCat("trainer", 1 - rank), "dense_parameters");
  const double diff = (other - g_dense).abs().max().item<double>();
  std::printf("trainer%d: loss %.4f -> %.4f over %ld steps; dense parameters differ from "
              "trainer%d's by at most %.2g\n",
              rank, first, last, static_cast<long>(kSteps), 1 - rank, diff);
  if (!(last < first)) {
    std::fprintf(stderr, "trainer%d: the loss did not fall\n", rank);
    return 1;
  }
  if (diff > 1e-5) {
    std::fprintf(stderr, "trainer%d: DDP did not keep the dense parameters equal\n", rank);
    return 1;
  }
  return 0;
}

int train(int rank) {
  rpc::init_rpc(absl::StrCat("trainer", rank), rank, kWorld);
  const int rc = train_and_check(rank);
  rpc::shutdown();
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const char* rank = std::getenv("RANK");
  if (rank != nullptr) return train(std::atoi(rank));
  rpc::LaunchOptions options;
  options.nprocs = kWorld;
  options.argv.assign(argv, argv + argc);
  options.argv[0] = "/proc/self/exe";  // this program, wherever it was started from
  options.timeout = absl::Minutes(3);
  rpc::LaunchResult result = rpc::launch(options);
  if (result.exit_code != 0) {
    std::fprintf(stderr, "consumer: %s\n", result.message.c_str());
    return result.exit_code;
  }
  std::printf("consumer: ok\n");
  return 0;
}
