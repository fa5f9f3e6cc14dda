// Distributed autograd and the distributed optimizer across real processes.
#include "autograd/dist_autograd.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding_bag.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/sparse_coo_tensor.h>
#include <ATen/ops/equal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/sgd.h>

#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "models/hybrid_model.h"
#include "models/split_model.h"
#include "optim/distributed_optimizer.h"
#include "rpc/rref/rref.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace dist_autograd = ddprpc::dist_autograd;
namespace optim = ddprpc::optim;
namespace models = ddprpc::models;

namespace {

using ddprpc::models::RemoteEmbedding;
using ddprpc::models::RemoteLinear;
at::Tensor init_param(std::vector<int64_t> shape, double phase) {
  return ddprpc::models::deterministic_param(std::move(shape), phase);
}
at::Tensor embedding_forward(const at::Tensor& w, const at::Tensor& i, const at::Tensor& o) {
  return ddprpc::models::embedding_bag_sum(w, i, o);
}

struct Batch {
  at::Tensor indices, offsets, target;
};

std::vector<Batch> make_batches(int n) {
  at::manual_seed(1234);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({at::randint(0, 10, {12}, at::kLong), at::arange(0, 12, 3, at::kLong),
                   at::randn({4, 3})});
  }
  return out;
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

MULTIPROCESS_TEST(DistAutogradTest, SplitModelMatchesLocalTraining, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() == 0) {
    auto emb = rpc::remote<RemoteEmbedding>("worker1", 10, 5);
    auto lin = rpc::remote<RemoteLinear>("worker2", 5, 3);
    std::vector<rpc::RRef<at::Tensor>> params = emb.rpc_sync(&RemoteEmbedding::parameters);
    for (auto& p : lin.rpc_sync(&RemoteLinear::parameters)) params.push_back(p);
    optim::DistributedOptimizer opt("sgd", {{"lr", 0.05}}, params);

    // The same model, in one process.
    at::Tensor w_emb = init_param({10, 5}, 0.1), w_lin = init_param({3, 5}, 0.7),
               b_lin = init_param({3}, 1.3);
    torch::optim::SGD local_opt({w_emb, w_lin, b_lin}, torch::optim::SGDOptions(0.05));

    for (const Batch& b : make_batches(20)) {
      dist_autograd::Context context;
      at::Tensor hidden = emb.rpc_sync(&RemoteEmbedding::forward, b.indices, b.offsets);
      EXPECT_TRUE(hidden.requires_grad());
      at::Tensor out = lin.rpc_sync(&RemoteLinear::forward, hidden);
      dist_autograd::backward(context.id(), {loss_of(out, b.target)});
      opt.step(context.id());

      local_opt.zero_grad();
      loss_of(at::linear(embedding_forward(w_emb, b.indices, b.offsets), w_lin, b_lin), b.target)
          .backward();
      local_opt.step();
    }
    EXPECT_TRUE(at::allclose(params[0].to_here(), w_emb.detach(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(params[1].to_here(), w_lin.detach(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(params[2].to_here(), b_lin.detach(), 1e-5, 1e-5));
    EXPECT_FALSE(params[1].to_here().equal(init_param({3, 5}, 0.7).detach()));  // it trained
  }
  rpc::shutdown();
}

at::Tensor scale(at::Tensor x, double k) { return x * k; }
DDPRPC_REGISTER_FUNCTION(scale);

// Nested: worker0 -> worker1 -> worker2, gradients flow back through both.
at::Tensor scale_via(std::string next, at::Tensor x) {
  return rpc::rpc_sync<at::Tensor>(next, "scale", x * 2.0, 3.0);
}
DDPRPC_REGISTER_FUNCTION(scale_via);

// Graphs in which one node is reached through several send functions, as
// PyTorch's "nested function" tests build them: the distributed backward
// gives what local autograd gives.
at::Tensor times3(at::Tensor x) { return x * 3; }
DDPRPC_REGISTER_FUNCTION(times3);

// t is sent on to `next` and used here as well.
at::Tensor use_and_send(std::string next, at::Tensor x) {
  at::Tensor t = x * 2;
  at::Tensor u = rpc::rpc_sync<at::Tensor>(next, "times3", t);
  return t + u;
}
DDPRPC_REGISTER_FUNCTION(use_and_send);

// One received tensor, through one local node, passed to two calls.
at::Tensor two_calls(std::string next, at::Tensor x) {
  at::Tensor z = x.sin();
  return rpc::rpc_sync<at::Tensor>(next, "times3", z) + rpc::rpc_sync<at::Tensor>(next, "times3", z);
}
DDPRPC_REGISTER_FUNCTION(two_calls);

MULTIPROCESS_TEST(DistAutogradTest, NodesReachedThroughSeveralSendsMatchLocalAutograd, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() == 0) {
    const at::Tensor start = at::arange(1, 5, at::kFloat) / 4;
    auto local = [&](auto f) {
      at::Tensor x = start.clone().requires_grad_(true);
      f(x).sum().backward();
      return x.grad();
    };
    auto distributed = [&](auto f) {
      at::Tensor x = start.clone().requires_grad_(true);
      dist_autograd::Context context;
      dist_autograd::backward(context.id(), {f(x).sum()});
      auto grads = dist_autograd::get_gradients(context.id());
      EXPECT_EQ(grads.size(), 1u);
      return grads.size() == 1 ? grads.at(x) : at::Tensor();
    };
    auto expect_same = [&](const char* what, auto local_f, auto dist_f) {
      at::Tensor want = local(local_f), got = distributed(dist_f);
      ASSERT_TRUE(got.defined()) << what;
      EXPECT_TRUE(at::allclose(got, want)) << what << ": got " << got << ", local autograd " << want;
    };
    auto local_use_and_send = [](at::Tensor x) {
      at::Tensor t = x * 2;
      return t + t * 3;
    };
    // worker0 -> worker1 -> worker2, and worker0 -> worker1 -> back to worker0.
    expect_same("nested call", local_use_and_send, [](at::Tensor x) {
      return rpc::rpc_sync<at::Tensor>("worker1", "use_and_send", "worker2", x);
    });
    expect_same("nested call back to the caller", local_use_and_send, [](at::Tensor x) {
      return rpc::rpc_sync<at::Tensor>("worker1", "use_and_send", "worker0", x);
    });
    expect_same("received tensor passed to two calls",
                [](at::Tensor x) { return x.sin() * 3 + x.sin() * 3; },
                [](at::Tensor x) { return rpc::rpc_sync<at::Tensor>("worker1", "two_calls", "worker2", x); });
    // The same tensor also used here and sent twice.
    expect_same("tensor used here and in two calls",
                [](at::Tensor x) { return x * x + x * 3 + x * 3; },
                [](at::Tensor x) {
                  return x * x + rpc::rpc_sync<at::Tensor>("worker1", "times3", x) +
                         rpc::rpc_sync<at::Tensor>("worker2", "times3", x);
                });
  }
  rpc::shutdown();
}

// Hooks on tensors run in the distributed backward as in local autograd: on
// a leaf (a pre-hook of its AccumulateGrad, which the pass does not run) and
// on a tensor in between.
MULTIPROCESS_TEST(DistAutogradTest, TensorHooksRunInTheDistributedBackward, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    auto run = [](bool distributed) {
      at::Tensor x = at::ones({3}).requires_grad_(true);
      x.register_hook([](at::Tensor g) { return g * 2; });
      auto forward = [&] {
        at::Tensor h = x * 3;
        h.register_hook([](at::Tensor g) { return g + 1; });
        return distributed ? rpc::rpc_sync<at::Tensor>("worker1", "times3", h) : h * 3;
      };
      if (!distributed) {
        forward().sum().backward();
        return x.grad();
      }
      dist_autograd::Context context;
      dist_autograd::backward(context.id(), {forward().sum()});
      return dist_autograd::get_gradients(context.id()).at(x);
    };
    at::Tensor want = run(false), got = run(true);  // ((1 * 3) + 1) * 3 * 2 = 24
    EXPECT_TRUE(at::allclose(got, want)) << "got " << got << ", local autograd " << want;
    EXPECT_TRUE(at::allclose(want, at::full({3}, 24.0)));
  }
  rpc::shutdown();
}

// A context's graph on this worker: (send functions, recv functions, known workers).
std::tuple<int64_t, int64_t, std::vector<int64_t>> graph_of(int64_t context_id) {
  const dist_autograd::ContextInfo info = dist_autograd::context_info(context_id);
  return {static_cast<int64_t>(info.send_functions.size()),
          static_cast<int64_t>(info.recv_functions),
          std::vector<int64_t>(info.known_workers.begin(), info.known_workers.end())};
}
DDPRPC_REGISTER_FUNCTION(graph_of);

// worker0 -> worker1 -> worker2: each worker records a send function per
// tensor-carrying message it sent and a recv function per one it received.
MULTIPROCESS_TEST(DistAutogradTest, GraphOfAContextIsVisibleOnEachWorker, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4}).requires_grad_(true);
    dist_autograd::Context context;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "scale_via", "worker2", x);
    const dist_autograd::ContextInfo mine = dist_autograd::context_info(context.id());
    ASSERT_EQ(mine.send_functions.size(), 1u);  // the request to worker1
    EXPECT_EQ(mine.send_functions.begin()->second, 1);
    EXPECT_EQ(mine.recv_functions, 1u);  // its reply
    EXPECT_EQ(mine.known_workers, (std::set<int>{1}));
    using Graph = std::tuple<int64_t, int64_t, std::vector<int64_t>>;
    // worker1: request in, request out to worker2, its reply in, reply out.
    EXPECT_EQ(rpc::rpc_sync<Graph>("worker1", "graph_of", context.id()),
              Graph(2, 2, std::vector<int64_t>{0, 2}));
    // worker2: worker1's request in, its reply out; it knows worker0 too,
    // whose graph_of call (in this context) just reached it.
    EXPECT_EQ(rpc::rpc_sync<Graph>("worker2", "graph_of", context.id()),
              Graph(1, 1, std::vector<int64_t>{0, 1}));
    // The counters of every layer in one map.
    const auto info = rpc::get_debug_info();
    EXPECT_EQ(info.at("dist_autograd.num_contexts"), "1");
    EXPECT_EQ(info.at("agent.worker"), "worker0");
    EXPECT_EQ(info.at("agent.num_workers"), "3");
    EXPECT_EQ(info.at("agent.num_pending_calls"), "0");
    EXPECT_EQ(info.at("agent.unreachable_workers"), "0");
    EXPECT_EQ(info.count("rref.owned"), 1u);
    dist_autograd::backward(context.id(), {y.sum()});
  }
  rpc::shutdown();
}

at::Tensor sum_of_squares(at::Tensor x) { return (x * x).sum(); }
DDPRPC_REGISTER_FUNCTION(sum_of_squares);

// RRef.backward(context_id): the pass starts on the RRef's owner, here
// another worker (rpc::remote in the context) or this one.
MULTIPROCESS_TEST(DistAutogradTest, BackwardFromAnRRefStartsOnItsOwner, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::randn({3}).requires_grad_(true);
    {
      dist_autograd::Context context;
      rpc::RRef<at::Tensor> loss = rpc::remote<at::Tensor>("worker1", "sum_of_squares", x);
      EXPECT_FALSE(loss.is_owner());
      dist_autograd::backward(context.id(), loss);
      auto grads = dist_autograd::get_gradients(context.id());
      ASSERT_EQ(grads.size(), 1u);
      EXPECT_TRUE(at::allclose(grads.at(x), 2 * x.detach()));
    }
    {
      dist_autograd::Context context;
      rpc::RRef<at::Tensor> loss(rpc::rpc_sync<at::Tensor>("worker1", "sum_of_squares", x));
      EXPECT_TRUE(loss.is_owner());
      dist_autograd::backward(context.id(), loss);
      EXPECT_TRUE(at::allclose(dist_autograd::get_gradients(context.id()).at(x), 2 * x.detach()));
    }
    // A root that is not a scalar fails on its owner, and the caller hears of it.
    dist_autograd::Context context;
    rpc::RRef<at::Tensor> vector = rpc::remote<at::Tensor>("worker1", "scale", x, 2.0);
    EXPECT_THROW(dist_autograd::backward(context.id(), vector), rpc::RpcError);
  }
  rpc::shutdown();
}

// The embedding gradient a context holds on this worker: (sparse?, the
// rows it names).
std::tuple<bool, std::vector<int64_t>> table_grad_rows(int64_t context_id) {
  auto grads = dist_autograd::get_gradients(context_id);
  if (grads.size() != 1) return {false, {}};
  at::Tensor g = grads.begin()->value();
  if (!g.is_sparse()) return {false, {}};
  at::Tensor rows = g.coalesce().indices()[0].contiguous();
  return {true, std::vector<int64_t>(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + rows.numel())};
}
DDPRPC_REGISTER_FUNCTION(table_grad_rows);

// A table with sparse gradients: the distributed backward leaves its owner
// a sparse gradient naming the rows looked up, and SGD changes those rows
// only (a row looked up twice by twice as much).
MULTIPROCESS_TEST(DistAutogradTest, SparseTableGradientsTouchOnlyTheRowsLookedUp, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    auto table = rpc::remote<models::EmbeddingTable>("worker1", int64_t{1000}, int64_t{4});
    table.rpc_sync(&models::EmbeddingTable::set_sparse, true);
    std::vector<rpc::RRef<at::Tensor>> params = table.rpc_sync(&models::EmbeddingTable::parameter_rrefs);
    const at::Tensor before = params[0].to_here();
    optim::DistributedOptimizer opt("sgd", {{"lr", 0.5}}, params);
    {
      dist_autograd::Context context;
      at::Tensor out = table.rpc_sync(&models::EmbeddingTable::forward,
                                      at::tensor(std::vector<int64_t>{3, 7, 7, 500}, at::kLong),
                                      at::tensor(std::vector<int64_t>{0, 2}, at::kLong));
      dist_autograd::backward(context.id(), {out.sum()});
      auto [sparse, rows] =
          rpc::rpc_sync<std::tuple<bool, std::vector<int64_t>>>("worker1", "table_grad_rows", context.id());
      EXPECT_TRUE(sparse);
      EXPECT_EQ(rows, (std::vector<int64_t>{3, 7, 500}));
      opt.step(context.id());
    }
    const at::Tensor delta = params[0].to_here() - before;
    const at::Tensor changed = delta.abs().sum(1).nonzero().flatten();
    EXPECT_TRUE(at::equal(changed, at::tensor(std::vector<int64_t>{3, 7, 500}, at::kLong))) << changed;
    EXPECT_TRUE(at::allclose(delta[3], at::full({4}, -0.5)));
    EXPECT_TRUE(at::allclose(delta[7], at::full({4}, -1.0)));
    EXPECT_TRUE(at::allclose(delta[500], at::full({4}, -0.5)));
  }
  rpc::shutdown();
}

at::Tensor dense_times3(at::Tensor s) { return s.to_dense() * 3; }
DDPRPC_REGISTER_FUNCTION(dense_times3);
at::Tensor sparse_twice(at::Tensor s) { return s * 2; }
DDPRPC_REGISTER_FUNCTION(sparse_twice);

// Sparse COO tensors as arguments and results, and as gradients coming
// back: the distributed backward gives what local autograd gives.
MULTIPROCESS_TEST(DistAutogradTest, SparseTensorsAsArgumentsResultsAndGradients, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor indices = at::tensor(std::vector<int64_t>{0, 2, 2, 1, 0, 3}, at::kLong).view({2, 3});
    at::Tensor s = at::sparse_coo_tensor(indices, at::randn({3}), {3, 4}).requires_grad_(true);
    at::Tensor w = at::randn({3, 4});
    // A sparse result.
    at::Tensor twice = rpc::rpc_sync<at::Tensor>("worker1", "sparse_twice", s.detach());
    EXPECT_TRUE(twice.is_sparse());
    EXPECT_TRUE(at::allclose(twice.to_dense(), s.detach().to_dense() * 2));
    // A sparse argument whose gradient (sparse) comes back.
    dist_autograd::Context context;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "dense_times3", s);
    dist_autograd::backward(context.id(), {(y * w).sum()});
    at::Tensor grad = dist_autograd::get_gradients(context.id()).at(s);
    at::Tensor local = s.detach().clone().requires_grad_(true);
    (local.to_dense() * 3 * w).sum().backward();
    EXPECT_EQ(grad.is_sparse(), local.grad().is_sparse());
    EXPECT_TRUE(at::allclose(grad.to_dense(), local.grad().to_dense()))
        << grad.to_dense() << "\n" << local.grad().to_dense();
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(DistAutogradTest, GradientsInContextThroughNestedCalls, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4}).requires_grad_(true);
    dist_autograd::Context context;
    EXPECT_EQ(context.id() >> 48, 0);  // worker id in the top bits
    EXPECT_EQ(dist_autograd::current_context_id(), context.id());
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "scale_via", "worker2", x);
    dist_autograd::backward(context.id(), {y.sum()});
    auto grads = dist_autograd::get_gradients(context.id());
    ASSERT_EQ(grads.size(), 1u);
    EXPECT_TRUE(at::allclose(grads.at(x), at::ones({4}) * 6.0));
    EXPECT_FALSE(x.grad().defined());  // never .grad
    {
      dist_autograd::Context inner;
      EXPECT_NE(inner.id(), context.id());
      EXPECT_EQ(dist_autograd::current_context_id(), inner.id());
    }
    EXPECT_EQ(dist_autograd::current_context_id(), context.id());
  }
  rpc::shutdown();
}

struct ExplodingBackward : public torch::autograd::Function<ExplodingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x * 1.0; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward exploded on purpose");
  }
};
at::Tensor fragile(at::Tensor x) { return ExplodingBackward::apply(x); }
DDPRPC_REGISTER_FUNCTION(fragile);

MULTIPROCESS_TEST(DistAutogradTest, RemoteBackwardErrorReachesTheCaller, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({2}).requires_grad_(true);
    dist_autograd::Context context;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "fragile", x);
    try {
      dist_autograd::backward(context.id(), {y.sum()});
      ADD_FAILURE() << "backward did not fail";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("backward exploded on purpose"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(optim::DistributedOptimizer("nonsense", {}, {rpc::RRef<at::Tensor>(x)}).step(context.id()),
                 std::exception);
  }
  rpc::shutdown();
}

int64_t num_contexts() { return static_cast<int64_t>(dist_autograd::num_contexts()); }
DDPRPC_REGISTER_FUNCTION(num_contexts);

MULTIPROCESS_TEST_WITH_TIMEOUT(DistAutogradTest, ContextsDoNotGrowOverTenThousandIterations, 2,
                               absl::Seconds(150)) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({2}).requires_grad_(true);
    for (int i = 0; i < 10000; ++i) {
      dist_autograd::Context context;
      at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "scale", x, 2.0);
      if (i % 1000 == 0) dist_autograd::backward(context.id(), {y.sum()});
    }
    EXPECT_EQ(dist_autograd::num_contexts(), 0u);
    int64_t remote = -1;
    absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline && (remote = rpc::rpc_sync<int64_t>("worker1", "num_contexts")) != 0) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(remote, 0);
  }
  rpc::shutdown();
}

}  // namespace

namespace {

// A context's release waits for the next call to the worker; when that call
// fails before it leaves (here: over max_message_bytes), the release must
// ride again instead of being lost with it.
MULTIPROCESS_TEST(DistAutogradTest, ReleaseOutlivesAFailedCallThatCarriedIt, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.max_message_bytes = 1 << 16;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, options);
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({2}).requires_grad_(true);
    {
      dist_autograd::Context context;
      rpc::rpc_sync<at::Tensor>("worker1", "scale", x, 2.0);
    }  // the release for worker1 now waits for the next call to it
    EXPECT_THROW(rpc::rpc_sync<at::Tensor>("worker1", "scale", at::ones({1 << 16}), 2.0),
                 rpc::RpcError);
    int64_t remote = -1;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline &&
           (remote = rpc::rpc_sync<int64_t>("worker1", "num_contexts")) != 0) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(remote, 0) << "worker1 still holds the context: its release was lost";
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(DistAutogradTest, TensorUsedTwiceAccumulatesBothGradients, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({3}).requires_grad_(true);
    dist_autograd::Context context;
    at::Tensor a = rpc::rpc_sync<at::Tensor>("worker1", "scale", x, 2.0);
    at::Tensor b = rpc::rpc_sync<at::Tensor>("worker1", "scale", x, 5.0);
    dist_autograd::backward(context.id(), {(a + b + x).sum()});
    EXPECT_TRUE(at::allclose(dist_autograd::get_gradients(context.id()).at(x), at::ones({3}) * 8.0));
  }
  rpc::shutdown();
}

// Two leaves whose gradients of one pass share their bytes (a tensor, and
// a view of it through w1.view): the context must not keep them so, or a
// later pass in the same context adds into both.
MULTIPROCESS_TEST(DistAutogradTest, LeavesWhoseGradientsShareBytesAccumulateApart, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor w1 = at::ones({6}).requires_grad_(true);
    at::Tensor w2 = at::ones({2, 3}).requires_grad_(true);
    dist_autograd::Context context;
    at::Tensor h = rpc::rpc_sync<at::Tensor>("worker1", "scale", w2 + w1.view({2, 3}), 1.0);
    dist_autograd::backward(context.id(), {h.sum()}, /*retain_graph=*/true);
    dist_autograd::backward(context.id(), {(h * 3).sum()});
    const auto grads = dist_autograd::get_gradients(context.id());
    EXPECT_TRUE(at::allclose(grads.at(w1), at::full({6}, 4.0))) << grads.at(w1);
    EXPECT_TRUE(at::allclose(grads.at(w2), at::full({2, 3}, 4.0))) << grads.at(w2);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(DistAutogradTest, ConcurrentContextsOnFourThreadsDoNotMix, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor x = at::ones({4}).requires_grad_(true);  // shared by all threads
    std::vector<std::thread> threads;
    std::vector<double> got(4, 0.0);
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 20; ++i) {
          dist_autograd::Context context;
          at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "scale", x, double(t + 1));
          dist_autograd::backward(context.id(), {y.sum()});
          got[t] = dist_autograd::get_gradients(context.id()).at(x)[0].item<double>();
          if (got[t] != t + 1) return;
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < 4; ++t) EXPECT_EQ(got[t], t + 1) << "thread " << t;
    EXPECT_FALSE(x.grad().defined());
  }
  rpc::shutdown();
}

}  // namespace
