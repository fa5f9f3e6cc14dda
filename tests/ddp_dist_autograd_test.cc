// DDP inside distributed autograd across real processes: the averaging
// happens in each worker's own backward pass, and a pass that a peer's
// backward starts on a worker (for a tensor it owns, not one of its DDP
// module's parameters) takes no part in the allreduce.
#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "rpc/store.h"
#include "tests/multiprocess.h"
#include "tests/rpc_store.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace dist_autograd = ddprpc::dist_autograd;
namespace ddp = ddprpc::ddp;

namespace {

// A tensor owned here, used by the other worker's forward pass through RPC.
at::Tensor g_scale;
at::Tensor scaled(at::Tensor x) { return x * g_scale; }
DDPRPC_REGISTER_FUNCTION(scaled);

at::Tensor flat_grads(dist_autograd::ContextId id, torch::nn::Linear& model) {
  c10::Dict<at::Tensor, at::Tensor> grads = dist_autograd::get_gradients(id);
  std::vector<at::Tensor> parts;
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(grads.contains(p)) << "no gradient for a DDP parameter";
    if (grads.contains(p)) parts.push_back(grads.at(p).reshape({-1}));
  }
  return at::cat(parts);
}

MULTIPROCESS_TEST(DdpDistAutogradTest, PeerStartedPassesTakeNoPartInTheAllreduce, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2);
  const int rank = mp::rank();
  g_scale = at::full({1, 4}, 2.0 + rank).requires_grad_(true);
  {
    at::manual_seed(7);  // the same initial model on both workers
    torch::nn::Linear model(4, 2);
    auto store = mp::connect_rpc_store();
    ddp::ProcessGroupOptions group_options;
    group_options.timeout = absl::Seconds(20);
    auto group = ddp::make_gloo_group(store, "test/ddp/", rank, 2, group_options);
    ddp::DdpOptions options;
    options.timeout = absl::Seconds(20);  // a mispaired allreduce fails, not hangs
    ddp::DistributedDataParallel ddp(model.ptr(), group, options);

    const at::Tensor input = at::full({3, 4}, 1.0 + rank);
    // Worker 1 starts late: worker 0's backward has by then run a pass on
    // worker 1 (for g_scale), which must not be taken for worker 1's own.
    if (rank == 1) absl::SleepFor(absl::Seconds(1));
    dist_autograd::Context context;
    at::Tensor x = rank == 0 ? rpc::rpc_sync<at::Tensor>("worker1", "scaled", input) : input * 1.0;
    at::Tensor loss = model->forward(x).pow(2).sum();
    dist_autograd::backward(context.id(), {loss});

    // Both workers hold the same average; it is the mean of what each
    // worker's pass gives alone (recomputed locally, without DDP).
    const at::Tensor averaged = flat_grads(context.id(), model);
    at::Tensor local;
    {
      torch::nn::Linear copy(4, 2);
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < copy->parameters().size(); ++i) {
          copy->parameters()[i].copy_(model->parameters()[i]);
        }
      }
      at::Tensor xin = rank == 0 ? input * at::full({1, 4}, 3.0) : input * 1.0;
      copy->forward(xin).pow(2).sum().backward();
      std::vector<at::Tensor> parts;
      for (const auto& p : copy->parameters()) parts.push_back(p.grad().reshape({-1}));
      local = at::cat(parts);
    }
    store->set(absl::StrCat("test/local/", rank),
               std::string(static_cast<const char*>(local.data_ptr()), local.nbytes()));
    const std::string other = store->get(absl::StrCat("test/local/", 1 - rank));
    ASSERT_EQ(other.size(), local.nbytes());
    at::Tensor other_local = at::empty_like(local);
    std::memcpy(other_local.data_ptr(), other.data(), other.size());
    EXPECT_TRUE(at::allclose(averaged, (local + other_local) / 2, 1e-5, 1e-6))
        << "worker" << rank << " got " << averaged << " expected " << (local + other_local) / 2;
  }
  rpc::shutdown();
}

}  // namespace
