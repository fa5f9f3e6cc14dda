// DDP inside distributed autograd across real processes: the averaging
// happens in each worker's own backward pass, a pass that a peer's backward
// starts on a worker (for a tensor it owns, not one of its DDP module's
// parameters) takes no part in the allreduce, several DDP instances alive at
// once each average their own parameters, and a gradient something else
// holds is not averaged under its holder, and hooks run on the engine's
// device threads know the pass.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rpc.h"
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

// A Gloo group of both workers under `prefix` whose collectives, like the
// DDP of ddp_options(), fail within 20 s: a mispaired allreduce fails, not
// hangs.
std::shared_ptr<ddp::ProcessGroup> both_workers_group(std::shared_ptr<ddprpc::rpc::Store> store,
                                                      const std::string& prefix) {
  ddp::ProcessGroupOptions group_options;
  group_options.same_host_allreduce = !mp::network_paths_only();
  group_options.timeout = absl::Seconds(20);
  return ddp::make_gloo_group(std::move(store), prefix, mp::rank(), 2, group_options);
}

ddp::DdpOptions ddp_options() {
  ddp::DdpOptions options;
  options.timeout = absl::Seconds(20);
  return options;
}

// Linear(4, 2) with the same initial values on both workers.
torch::nn::Linear same_linear_on_both_workers() {
  at::manual_seed(7);
  return torch::nn::Linear(4, 2);
}

MULTIPROCESS_TEST(DdpDistAutogradTest, PeerStartedPassesTakeNoPartInTheAllreduce, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  const int rank = mp::rank();
  g_scale = at::full({1, 4}, 2.0 + rank).requires_grad_(true);
  {
    torch::nn::Linear model = same_linear_on_both_workers();
    auto store = mp::connect_rpc_store();
    ddp::DistributedDataParallel ddp(model.ptr(), both_workers_group(store, "test/ddp/"),
                                     ddp_options());

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

// What `model`'s parameters get, flattened, from a local backward pass of
// `loss_of(model)` on a copy of it (no DDP, no distributed autograd).
at::Tensor local_grads(torch::nn::Linear& model,
                       const std::function<at::Tensor(torch::nn::Linear&)>& loss_of) {
  torch::nn::Linear copy(model->options);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < copy->parameters().size(); ++i) {
      copy->parameters()[i].copy_(model->parameters()[i]);
    }
  }
  loss_of(copy).backward();
  std::vector<at::Tensor> parts;
  for (const auto& p : copy->parameters()) parts.push_back(p.grad().reshape({-1}));
  return at::cat(parts);
}

// The mean of `local` over both workers (exchanged through the store as `key`).
at::Tensor mean_over_workers(ddprpc::rpc::Store& store, const std::string& key,
                             const at::Tensor& local) {
  const int rank = mp::rank();
  store.set(absl::StrCat(key, "/", rank),
            std::string(static_cast<const char*>(local.data_ptr()), local.nbytes()));
  const std::string other = store.get(absl::StrCat(key, "/", 1 - rank));
  EXPECT_EQ(other.size(), local.nbytes());
  at::Tensor other_local = at::empty_like(local);
  std::memcpy(other_local.data_ptr(), other.data(), std::min(other.size(), local.nbytes()));
  return (local + other_local) / 2;
}

// Two DDP instances over disjoint modules, alive at once and sharing one
// process group: each averages its own parameters in the distributed
// backward pass, and destroying one leaves the other averaging.
MULTIPROCESS_TEST(DdpDistAutogradTest, InstancesAliveAtOnceEachAverageTheirOwnParameters, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  const int rank = mp::rank();
  {
    at::manual_seed(7);  // the same initial models on both workers
    torch::nn::Linear first(4, 2);
    torch::nn::Linear second(4, 3);
    auto store = mp::connect_rpc_store();
    auto group = both_workers_group(store, "test/two_ddp/");
    const ddp::DdpOptions options = ddp_options();
    ddp::DistributedDataParallel first_ddp(first.ptr(), group, options);

    // Each worker's own input: unaveraged gradients differ between workers.
    const at::Tensor input = at::full({3, 4}, 1.0 + rank);
    auto first_loss = [&](torch::nn::Linear& m) { return m->forward(input).pow(2).sum(); };
    auto second_loss = [&](torch::nn::Linear& m) { return m->forward(input * 2).abs().sum(); };
    const at::Tensor first_local = local_grads(first, first_loss);
    const at::Tensor first_mean = mean_over_workers(*store, "test/two_ddp/first", first_local);
    ASSERT_FALSE(at::allclose(first_local, first_mean)) << "the check could not fail";

    {
      ddp::DistributedDataParallel second_ddp(second.ptr(), group, options);
      const at::Tensor second_local = local_grads(second, second_loss);
      const at::Tensor second_mean =
          mean_over_workers(*store, "test/two_ddp/second", second_local);
      ASSERT_FALSE(at::allclose(second_local, second_mean)) << "the check could not fail";

      dist_autograd::Context context;
      dist_autograd::backward(context.id(), {first_loss(first) + second_loss(second)});
      const at::Tensor first_got = flat_grads(context.id(), first);
      const at::Tensor second_got = flat_grads(context.id(), second);
      EXPECT_TRUE(at::allclose(first_got, first_mean, 1e-5, 1e-6))
          << "worker" << rank << ": the first instance's parameters got " << first_got
          << ", not their average " << first_mean;
      EXPECT_TRUE(at::allclose(second_got, second_mean, 1e-5, 1e-6))
          << "worker" << rank << ": the second instance's parameters got " << second_got
          << ", not their average " << second_mean;
    }

    // The second instance is gone: its parameters keep this worker's own
    // gradients, while the first instance still averages.
    dist_autograd::Context context;
    dist_autograd::backward(context.id(), {first_loss(first) + second_loss(second)});
    const at::Tensor first_got = flat_grads(context.id(), first);
    const at::Tensor second_got = flat_grads(context.id(), second);
    EXPECT_TRUE(at::allclose(first_got, first_mean, 1e-5, 1e-6))
        << "worker" << rank << ": after the second instance was destroyed the first one's "
        << "parameters got " << first_got << ", not their average " << first_mean;
    EXPECT_TRUE(at::allclose(second_got, local_grads(second, second_loss), 1e-5, 1e-6))
        << "worker" << rank << ": the destroyed instance still reduced its parameters";
  }
  rpc::shutdown();
}

// The average replaces a pass's gradients in place only where nothing else
// holds them: a gradient a tensor hook kept keeps this worker's own value,
// while the context gets the average.
MULTIPROCESS_TEST(DdpDistAutogradTest, GradientsHeldElsewhereAreNotAveragedUnderTheirHolder, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  const int rank = mp::rank();
  {
    torch::nn::Linear model = same_linear_on_both_workers();
    auto store = mp::connect_rpc_store();
    ddp::DistributedDataParallel ddp(model.ptr(), both_workers_group(store, "test/held/"),
                                     ddp_options());

    const at::Tensor input = at::full({3, 4}, 1.0 + rank);
    auto loss_of = [&](torch::nn::Linear& m) { return m->forward(input).pow(2).sum(); };
    const at::Tensor local = local_grads(model, loss_of);
    const at::Tensor mean = mean_over_workers(*store, "test/held/mean", local);
    ASSERT_FALSE(at::allclose(local, mean)) << "the check could not fail";

    at::Tensor kept;  // the weight's gradient as the hook saw it
    model->weight.register_hook([&kept](const at::Tensor& grad) { kept = grad; });
    dist_autograd::Context context;
    dist_autograd::backward(context.id(), {loss_of(model)});
    EXPECT_TRUE(at::allclose(flat_grads(context.id(), model), mean, 1e-5, 1e-6))
        << "worker" << rank << ": the context did not get the average";
    ASSERT_TRUE(kept.defined());
    const at::Tensor local_weight = local.narrow(0, 0, model->weight.numel()).view(kept.sizes());
    EXPECT_TRUE(at::allclose(kept, local_weight, 1e-5, 1e-6))
        << "worker" << rank << ": the hook's gradient was averaged under it: " << kept
        << ", its own " << local_weight;
  }
  rpc::shutdown();
}

// libtorch's engine runs the nodes of a CUDA tensor, and the hooks of a
// CUDA parameter (DDP's among them), on that device's thread, carrying the
// pass's thread-local state there. A thread given that state while the
// pass runs, as the engine's device threads are, knows the pass's context,
// and DDP's hook run there leaves the averaging to the pass instead of
// starting a local reduction of its own (which needs the engine's thread
// and fails here). Once the pass is over, that state carries no context.
MULTIPROCESS_TEST(DdpDistAutogradTest, HooksOnTheEnginesDeviceThreadsKnowThePass, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  const int rank = mp::rank();
  {
    torch::nn::Linear model = same_linear_on_both_workers();
    auto store = mp::connect_rpc_store();
    ddp::DistributedDataParallel ddp(model.ptr(), both_workers_group(store, "test/device/"),
                                     ddp_options());
    const at::Tensor input = at::full({3, 4}, 1.0 + rank);
    auto loss_of = [&](torch::nn::Linear& m) { return m->forward(input).pow(2).sum(); };
    const at::Tensor mean =
        mean_over_workers(*store, "test/device/mean", local_grads(model, loss_of));

    // During the pass, on the pass's thread: another thread, given this
    // thread's state, runs the weight's hooks (DDP's and this one) as a
    // device thread would.
    bool in_device_thread = false;
    std::optional<at::ThreadLocalState> state;
    dist_autograd::ContextId seen = -2;
    std::string error;
    model->weight.register_hook([&](const at::Tensor& grad) {
      if (in_device_thread || state) return;
      state.emplace();
      std::thread device([&] {
        at::ThreadLocalStateGuard as_in_the_pass(*state);
        in_device_thread = true;
        seen = dist_autograd::current_context_id();
        try {
          for (const auto& hook : torch::autograd::impl::hooks(model->weight)) (*hook)({grad});
        } catch (const std::exception& e) {
          error = e.what();
        }
      });
      device.join();
      in_device_thread = false;
    });
    dist_autograd::Context context;
    dist_autograd::backward(context.id(), {loss_of(model)});
    ASSERT_TRUE(state.has_value());
    EXPECT_EQ(seen, context.id()) << "worker" << rank << ": the device thread saw no context";
    EXPECT_EQ(error, "") << "worker" << rank << ": DDP's hook reduced on its own";
    EXPECT_TRUE(at::allclose(flat_grads(context.id(), model), mean, 1e-5, 1e-6));

    dist_autograd::ContextId after = -2;
    std::thread([&] {
      at::ThreadLocalStateGuard saved_in_the_pass(*state);
      after = dist_autograd::current_context_id();
    }).join();
    EXPECT_EQ(after, -1) << "the pass's state carried its context beyond the pass";
    dist_autograd::ContextId outside = -2;
    std::thread([&] { outside = dist_autograd::current_context_id(); }).join();
    EXPECT_EQ(outside, -1) << "a thread outside any pass";

    // The next pass still averages.
    state.reset();
    dist_autograd::Context next;
    dist_autograd::backward(next.id(), {loss_of(model)});
    EXPECT_TRUE(at::allclose(flat_grads(next.id(), model), mean, 1e-5, 1e-6))
        << "worker" << rank << ": the pass after got " << flat_grads(next.id(), model);
  }
  rpc::shutdown();
}

}  // namespace
