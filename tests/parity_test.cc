// Behaviours PyTorch's RPC test suite relies on that ddprpc supports, each
// checked here: init errors and init after shutdown, futures inside a
// callee, async functions chained and fanned out (and failing), async
// execution through remote() and RRef methods, RRefs of RRefs, RPC beside a
// process group in either order, and distributed autograd on larger graphs
// (several outputs and roots, mixed requires_grad, retain_graph, argument
// checks, a worker dying during backward).
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "ddp/process_group.h"
#include "gtest/gtest.h"
#include "rpc/profiler/profiler.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "tests/multiprocess.h"
#include "tests/rpc_store.h"

namespace rpc = ddprpc::rpc;
namespace ddp = ddprpc::ddp;
namespace mp = ddprpc::testing;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

std::string other() { return mp::worker_name(1 - mp::rank()); }

int64_t add_ints(int64_t a, int64_t b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add_ints);

// ---------------------------------------------------------------------------
// Initialization.

MULTIPROCESS_TEST(ParityTest, InitErrorsAndInitAgainAfterShutdown, 2) {
  for (const char* bad : {"", "two\nlines"}) {
    try {
      rpc::init_rpc(bad, mp::rank(), 2, mp::backend_options());
      ADD_FAILURE() << "a bad name was accepted";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kInvalidArgument) << e.what();
    }
  }
  EXPECT_THROW(rpc::init_rpc(mp::worker_name(), 2, 2, mp::backend_options()), rpc::RpcError);  // rank outside the world
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  try {
    rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
    ADD_FAILURE() << "init_rpc twice was accepted";
  } catch (const rpc::RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("already initialized"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rpc::rpc_sync<int64_t>(other(), "add_ints", 1, 2), 3);
  EXPECT_TRUE(rpc::shutdown());
  EXPECT_THROW(rpc::rpc_sync<int64_t>(other(), "add_ints", 1, 2), rpc::RpcError);
  // Again, under new names.
  rpc::init_rpc(absl::StrCat("again", mp::rank()), mp::rank(), 2, mp::backend_options());
  EXPECT_EQ(rpc::rpc_sync<int64_t>(absl::StrCat("again", 1 - mp::rank()), "add_ints", 2, 3), 5);
  EXPECT_TRUE(rpc::shutdown());
}

MULTIPROCESS_TEST(ParityTest, DuplicateNamesAreRefused, 2) {
  try {
    rpc::init_rpc("same", mp::rank(), 2, mp::backend_options());
    ADD_FAILURE() << "two workers named 'same' were accepted";
    rpc::shutdown(false);
  } catch (const rpc::RpcError& e) {
    // Rank 0 reads both records before it stops the store; rank 1 may find
    // the store gone first.
    if (mp::rank() == 0) {
      EXPECT_NE(std::string(e.what()).find("names must be unique"), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------
// Futures and async execution.

// A callee that makes its own call and chains on it.
int64_t call_and_chain(std::string to, int64_t x) {
  rpc::Future<int64_t> f = rpc::rpc_async<int64_t>(to, "add_ints", x, 1)
                               .then([](const rpc::Future<int64_t>& r) { return r.value() * 10; });
  return f.value();
}
DDPRPC_REGISTER_FUNCTION(call_and_chain);

// Async: n hops, alternating between the two workers, each adding 1.
rpc::Future<int64_t> chain(int64_t n) {
  if (n == 0) return rpc::make_ready_future(int64_t{0});
  return rpc::rpc_async<int64_t>(other(), "chain", n - 1)
      .then([](const rpc::Future<int64_t>& f) { return f.value() + 1; });
}
DDPRPC_REGISTER_FUNCTION(chain);

// Async: k calls at once to the other worker, their sum.
rpc::Future<int64_t> fan_out(int64_t k) {
  std::vector<rpc::Future<int64_t>> calls;
  for (int64_t i = 0; i < k; ++i) calls.push_back(rpc::rpc_async<int64_t>(other(), "add_ints", i, 0));
  return rpc::collect_all(calls).then([](const rpc::Future<std::vector<rpc::Future<int64_t>>>& all) {
    int64_t sum = 0;
    for (const auto& f : all.value()) sum += f.value();
    return sum;
  });
}
DDPRPC_REGISTER_FUNCTION(fan_out);

// Async functions that fail: through their future, or before returning one.
rpc::Future<int64_t> fails_later() {
  rpc::Future<int64_t> f;
  f.set_error(std::make_exception_ptr(std::runtime_error("failed in the future")));
  return f;
}
DDPRPC_REGISTER_FUNCTION(fails_later);
rpc::Future<int64_t> fails_at_once() { throw std::runtime_error("failed before any future"); }
DDPRPC_REGISTER_FUNCTION(fails_at_once);

MULTIPROCESS_TEST(ParityTest, FuturesInCalleesAndAsyncFunctionsChainedFannedOutAndFailing, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "call_and_chain", "worker0", 4), 50);
    // 20 hops between the two workers, none holding a thread while it waits.
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "chain", 20), 20);
    EXPECT_EQ(rpc::rpc_async<int64_t>("worker1", "fan_out", 30).value(), 435);
    for (const char* fn : {"fails_later", "fails_at_once"}) {
      SCOPED_TRACE(fn);
      const std::string why = std::string(fn) == "fails_later" ? "failed in the future"
                                                                 : "failed before any future";
      try {
        rpc::rpc_sync<int64_t>("worker1", fn);
        ADD_FAILURE() << "no error";
      } catch (const rpc::RpcError& e) {
        EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      }
      rpc::Future<int64_t> f = rpc::rpc_async<int64_t>("worker1", fn);
      ASSERT_TRUE(f.wait_for(absl::Seconds(20)));
      EXPECT_TRUE(f.has_error());
      auto rref = rpc::remote<int64_t>("worker1", fn);
      EXPECT_THROW(rref.to_here(), rpc::RpcError);
    }
    // Async execution behind remote().
    EXPECT_EQ(rpc::remote<int64_t>("worker1", "chain", 6).to_here(), 6);
  }
  rpc::shutdown();
}

// A class whose method is async: it answers once `release` is called.
class Gate {
 public:
  rpc::Future<int64_t> wait_open(int64_t x) {
    return opened_.then([x](const rpc::Future<int64_t>& f) { return f.value() + x; });
  }
  void open(int64_t value) { opened_.set_result(value); }

 private:
  rpc::Future<int64_t> opened_;
};
const auto gate_class = rpc::register_class<Gate>("parity.Gate")
                            .constructor<>()
                            .method("wait_open", &Gate::wait_open)
                            .method("open", &Gate::open);

// An RRef owned by the callee, returned to the caller.
rpc::RRef<int64_t> make_rref(int64_t x) { return rpc::RRef<int64_t>(x * 2); }
DDPRPC_REGISTER_FUNCTION(make_rref);

MULTIPROCESS_TEST(ParityTest, AsyncRRefMethodsAndRRefsOfRRefs, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    rpc::RRef<Gate> gate = rpc::remote<Gate>("worker1");
    rpc::Future<int64_t> waiting = gate.rpc_async(&Gate::wait_open, 5);
    rpc::RRef<int64_t> later = gate.remote(&Gate::wait_open, 7);
    EXPECT_FALSE(waiting.wait_for(absl::Milliseconds(50)));  // the gate is shut
    // RRef proxies under a timeout of their own, shorter than the default.
    try {
      gate.rpc_sync(rpc::CallOptions{absl::Milliseconds(50)}, &Gate::wait_open, 1);
      ADD_FAILURE() << "a call to a shut gate returned";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kTimeout) << e.what();
    }
    rpc::RRef<int64_t> impatient = gate.remote(rpc::CallOptions{absl::Milliseconds(50)}, &Gate::wait_open, 2);
    const absl::Time start = absl::Now();
    while (!impatient.confirmed_by_owner() && absl::Now() - start < absl::Seconds(10)) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    try {
      impatient.to_here();
      ADD_FAILURE() << "an RRef whose creation timed out was fetched";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kTimeout) << e.what();
    }
    gate.rpc_sync(&Gate::open, 100);
    EXPECT_EQ(waiting.value(), 105);
    EXPECT_EQ(later.to_here(), 107);
    // An RRef whose value is an RRef (both owned by worker1).
    rpc::RRef<rpc::RRef<int64_t>> outer = rpc::remote<rpc::RRef<int64_t>>("worker1", "make_rref", 21);
    rpc::RRef<int64_t> inner = outer.to_here();
    EXPECT_EQ(inner.owner().name, "worker1");
    EXPECT_EQ(inner.to_here(), 42);
  }
  rpc::shutdown();
}

// ---------------------------------------------------------------------------
// RPC beside a process group, started in either order.

MULTIPROCESS_TEST(ParityTest, RpcAndAProcessGroupInEitherOrder, 2) {
  const int port = std::atoi(std::getenv("MASTER_PORT"));
  {
    // The group first (its own store, on the next port), then RPC.
    auto group = ddp::init_process_group("gloo", absl::StrCat("tcp://127.0.0.1:", port + 1),
                                         mp::rank(), 2);
    rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
    at::Tensor t = at::full({3}, mp::rank() + 1.0);
    group->allreduce({t}, ddp::ReduceOp::kSum)->wait(absl::Seconds(30));
    EXPECT_TRUE(at::allclose(t, at::full({3}, 3.0)));
    EXPECT_EQ(rpc::rpc_sync<int64_t>(other(), "add_ints", 1, 1), 2);
    EXPECT_TRUE(rpc::shutdown());
  }
  {
    // RPC first, then a group through the RPC agent's store.
    rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
    ddp::ProcessGroupOptions group_options;
    group_options.same_host_allreduce = !mp::network_paths_only();
    auto group =
        ddp::make_gloo_group(mp::connect_rpc_store(), "parity/", mp::rank(), 2, group_options);
    at::Tensor t = at::full({3}, mp::rank() * 10.0);
    group->allreduce({t}, ddp::ReduceOp::kMax)->wait(absl::Seconds(30));
    EXPECT_TRUE(at::allclose(t, at::full({3}, 10.0)));
    EXPECT_EQ(rpc::rpc_sync<int64_t>(other(), "add_ints", 2, 2), 4);
    group.reset();
    EXPECT_TRUE(rpc::shutdown());
  }
}

// ---------------------------------------------------------------------------
// Distributed autograd on larger graphs.

// Two outputs of one call, one of them from an argument that needs no grad.
std::tuple<at::Tensor, at::Tensor> two_outputs(at::Tensor a, at::Tensor b) {
  return {a * b, a.sin() + b};
}
DDPRPC_REGISTER_FUNCTION(two_outputs);

struct DieInBackward : public torch::autograd::Function<DieInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x * 1.0; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    mp::die_abruptly();  // this worker dies in the middle of the pass
  }
};
at::Tensor fragile(at::Tensor x) { return DieInBackward::apply(x); }
DDPRPC_REGISTER_FUNCTION(fragile);

MULTIPROCESS_TEST(ParityTest, LargerGraphsRetainGraphAndArgumentChecks, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    at::Tensor a = at::randn({4}).requires_grad_(true);
    at::Tensor b = at::randn({4});  // needs no grad
    at::Tensor c = at::randn({4}).requires_grad_(true);
    {
      dist_autograd::Context context;
      auto [p, q] = rpc::rpc_sync<std::tuple<at::Tensor, at::Tensor>>("worker1", "two_outputs", a, b);
      // Two roots, one also using a local leaf; retain the graph and run again.
      at::Tensor r1 = (p * c).sum(), r2 = q.sum();
      dist_autograd::backward(context.id(), {r1, r2}, /*retain_graph=*/true);
      dist_autograd::backward(context.id(), {r1, r2});
      auto grads = dist_autograd::get_gradients(context.id());
      EXPECT_EQ(grads.size(), 2u);  // a and c; b needs none
      // Local autograd, run twice as well.
      at::Tensor la = a.detach().clone().requires_grad_(true), lc = c.detach().clone().requires_grad_(true);
      at::Tensor l1 = (la * b * lc).sum() + (la.sin() + b).sum();
      l1.backward({}, /*retain_graph=*/true);
      l1.backward();
      EXPECT_TRUE(at::allclose(grads.at(a), la.grad(), 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(grads.at(c), lc.grad(), 1e-5, 1e-6));
      // Argument checks.
      EXPECT_THROW(dist_autograd::backward(context.id(), {p}), std::exception);  // not a scalar
      EXPECT_THROW(dist_autograd::backward(context.id(), {b.sum()}), std::exception);  // no grad
      EXPECT_THROW(dist_autograd::backward(context.id() + 12345, {r1}), std::exception);
    }
    // worker1 dies while it runs its part of the pass: the pass fails, soon.
    dist_autograd::Context context;
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "fragile", a);
    const absl::Time start = absl::Now();
    try {
      dist_autograd::backward(context.id(), {y.sum()});
      ADD_FAILURE() << "the pass succeeded without worker1";
    } catch (const rpc::RpcError& e) {
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  }
  EXPECT_EQ(rpc::shutdown(), false);  // worker1 died: not a clean shutdown
}

// The profiler sees the distributed backward's RPC nodes: the recv
// function's part here, and the send function's part on the worker that
// continued the pass (sent back with its reply).
MULTIPROCESS_TEST(ParityTest, ProfilerSeesTheSendAndRecvFunctionsOfABackwardPass, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 1) {
    at::Tensor a = at::randn({4}).requires_grad_(true);
    dist_autograd::Context context;
    auto [p, q] = rpc::rpc_sync<std::tuple<at::Tensor, at::Tensor>>("worker0", "two_outputs", a,
                                                                    at::ones({4}));
    rpc::profiler::Profile profile;
    dist_autograd::backward(context.id(), {(p + q).sum()});
    profile.stop();
    bool recv_here = false, send_there = false;
    std::string names;
    for (const auto& e : profile.events()) {
      names += e.name + "\n";
      recv_here |= e.name == "RecvRpcBackward" && e.node == 1;
      send_there |= e.name.find("#remote_op: SendRpcBackward") != std::string::npos && e.node == 0;
    }
    EXPECT_TRUE(recv_here) << names;
    EXPECT_TRUE(send_there) << names;
  }
  rpc::shutdown();
}

}  // namespace
