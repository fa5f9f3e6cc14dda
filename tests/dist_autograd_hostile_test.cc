// Distributed autograd against forged messages: only the workers taking
// part in a context may release it or send gradients into it, gradients
// must fit the tensors they are for, contexts that other workers' messages
// create are bounded (in number and bytes, also per sending worker) and
// dropped when idle, a refused message leaves no context, and a late reply
// does not bring back a context its creator has left.
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "gtest/gtest.h"
#include "rpc/core/internal/fault.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "rpc/testing/raw_peer.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;
namespace wire = ddprpc::wire;
namespace dist_autograd = ddprpc::dist_autograd;

namespace {

constexpr char kPropagate[] = "__dist_autograd.propagate";
constexpr char kFlushReleases[] = "__dist_autograd.flush_releases";

at::Tensor square(at::Tensor x) { return x * x; }
DDPRPC_REGISTER_FUNCTION(square);

int64_t contexts_here() { return static_cast<int64_t>(dist_autograd::num_contexts()); }
DDPRPC_REGISTER_FUNCTION(contexts_here);

int64_t set_idle_timeout_ms(int64_t ms) {
  dist_autograd::set_idle_context_timeout(absl::Milliseconds(ms));
  return ms;
}
DDPRPC_REGISTER_FUNCTION(set_idle_timeout_ms);

int64_t set_max_remote_bytes(int64_t bytes) {
  dist_autograd::set_max_remote_context_bytes(bytes);
  return dist_autograd::remote_context_bytes();
}
DDPRPC_REGISTER_FUNCTION(set_max_remote_bytes);

// Sets both byte bounds; returns what worker `sender`'s messages brought
// into contexts here.
int64_t set_remote_bounds(int64_t bytes, int64_t per_worker, int64_t sender) {
  dist_autograd::set_max_remote_context_bytes(bytes);
  dist_autograd::set_max_remote_context_bytes_per_worker(per_worker);
  return dist_autograd::remote_context_bytes_from(static_cast<int>(sender));
}
DDPRPC_REGISTER_FUNCTION(set_remote_bounds);

int64_t sleep_ms(int64_t ms) {
  absl::SleepFor(absl::Milliseconds(ms));
  return ms;
}
DDPRPC_REGISTER_FUNCTION(sleep_ms);

// Sends one request as worker `as` to `to` and returns the reply.
rpc::internal::Frame raw_call(const std::string& to, int as, rpc::internal::Frame request) {
  rpc::testing::RawStream stream(rpc::get_worker_info(to).address, rpc::get_worker_info(to).id, as);
  EXPECT_TRUE(stream.write_bytes(rpc::testing::frame_bytes(request)));
  auto reply = stream.read();
  EXPECT_TRUE(reply.has_value());
  return reply ? *reply : rpc::internal::Frame();
}

void add_ext(rpc::internal::Frame* frame, const std::string& key, const std::string& value) {
  auto* e = frame->header.add_ext();
  e->set_key(key);
  e->set_value(value);
}

void expect_error(const rpc::internal::Frame& reply, rpc::ErrorCode code, const std::string& needle) {
  EXPECT_EQ(reply.header.kind(), wire::ERROR);
  EXPECT_EQ(reply.header.error_code(), static_cast<int>(code)) << reply.header.error();
  EXPECT_NE(reply.header.error().find(needle), std::string::npos) << reply.header.error();
}

MULTIPROCESS_TEST(DistAutogradHostileTest, OnlyParticipantsReleaseOrFeedAContext, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  rpc::Store& store = rpc::current_agent()->store();
  if (mp::rank() == 0) {
    dist_autograd::Context context;
    at::Tensor x = at::full({3}, 2.0).requires_grad_(true);
    at::Tensor y = rpc::rpc_sync<at::Tensor>("worker1", "square", x);
    store.set("context", absl::StrCat(context.id()));
    store.get("attacked");
    // Worker 1 sent its reply's tensors to us only: the first send function
    // it ever made, message id (1 << 48) | 1.
    const int64_t message = (int64_t{1} << 48) | 1;
    // Gradients that do not fit the tensor they are for are refused.
    auto wrong = rpc::testing::request_frame(
        0, 1, kPropagate,
        {context.id(), message, c10::IValue(c10::List<at::Tensor>({at::ones({4})})), false});
    expect_error(raw_call("worker1", 0, wrong), rpc::ErrorCode::kRemoteException, "does not match");
    // The context survived everything: backward gives d(sum x^2)/dx = 2x.
    dist_autograd::backward(context.id(), {y.sum()});
    auto grads = dist_autograd::get_gradients(context.id());
    ASSERT_EQ(grads.size(), 1u);
    EXPECT_TRUE(at::allclose(grads.at(x), at::full({3}, 4.0)));
  }
  if (mp::rank() == 2) {
    int64_t id;
    ASSERT_TRUE(absl::SimpleAtoi(store.get("context"), &id));
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "contexts_here");
    ASSERT_GE(before, 1);
    // A release of a context we take no part in, riding on a call.
    auto release = rpc::testing::request_frame(2, 1, kFlushReleases, {});
    add_ext(&release, "dist_autograd.released", absl::StrCat(id));
    EXPECT_EQ(raw_call("worker1", 2, release).header.kind(), wire::RESPONSE);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before);
    // The same after joining the context with a message of our own first:
    // worker 1 honours only the creator and the worker that brought it the
    // context, and would otherwise also forward the release to worker 0.
    auto join = rpc::testing::request_frame(2, 4, "square", {at::ones({1})});
    add_ext(&join, "dist_autograd.context", absl::StrCat(id));
    EXPECT_EQ(raw_call("worker1", 2, join).header.kind(), wire::RESPONSE);
    auto again = rpc::testing::request_frame(2, 5, kFlushReleases, {});
    add_ext(&again, "dist_autograd.released", absl::StrCat(id));
    EXPECT_EQ(raw_call("worker1", 2, again).header.kind(), wire::RESPONSE);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before);
    // Gradients for tensors that were sent to worker 0, not to us.
    auto feed = rpc::testing::request_frame(
        2, 2, kPropagate,
        {id, (int64_t{1} << 48) | 1, c10::IValue(c10::List<at::Tensor>({at::ones({3})})), false});
    expect_error(raw_call("worker1", 2, feed), rpc::ErrorCode::kPermissionDenied,
                 "did not receive");
    // A context id no worker of the job could have made.
    auto bogus = rpc::testing::request_frame(2, 3, "square", {at::ones({1})});
    add_ext(&bogus, "dist_autograd.context", absl::StrCat(int64_t{9} << 48 | 5));
    expect_error(raw_call("worker1", 2, bogus), rpc::ErrorCode::kInvalidArgument,
                 "not made by a worker of this job");
    store.set("attacked", "1");
  }
  rpc::shutdown();
}

// A context that another worker's message created and that nothing uses
// any more is dropped after the idle timeout, and a later message naming it
// does not make it again.
MULTIPROCESS_TEST(DistAutogradHostileTest, IdleContextsOfOtherWorkersAreDropped, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    rpc::rpc_sync<int64_t>("worker1", "set_idle_timeout_ms", 2000);
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "contexts_here");
    // A context of ours that we never release (as if we died).
    auto request = rpc::testing::request_frame(0, 1, "square", {at::ones({1})});
    add_ext(&request, "dist_autograd.context", absl::StrCat(int64_t{0} << 48 | 4242));
    EXPECT_EQ(raw_call("worker1", 0, request).header.kind(), wire::RESPONSE);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before + 1);
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (rpc::rpc_sync<int64_t>("worker1", "contexts_here") > before && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before);
    auto late = rpc::testing::request_frame(0, 2, "square", {at::ones({1})});
    add_ext(&late, "dist_autograd.context", absl::StrCat(int64_t{0} << 48 | 4242));
    EXPECT_EQ(raw_call("worker1", 0, late).header.kind(), wire::RESPONSE);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before);
  }
  rpc::shutdown();
}

// The tensors another worker's requests bring into its contexts stay until
// the context is released: all such contexts together hold at most
// set_max_remote_context_bytes of them, and a release gives them back.
MULTIPROCESS_TEST(DistAutogradHostileTest, ReceivedTensorsOfOtherWorkersContextsAreBoundedInBytes, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "set_max_remote_bytes", int64_t{1} << 20), 0);
    const at::Tensor x = at::ones({(256 << 10) / 4}).requires_grad_();  // 256 KiB
    {
      dist_autograd::Context context;
      for (int i = 0; i < 4; ++i) rpc::rpc_sync<at::Tensor>("worker1", "square", x);
      try {
        rpc::rpc_sync<at::Tensor>("worker1", "square", x);
        ADD_FAILURE() << "a fifth 256 KiB tensor was taken past a 1 MiB bound";
      } catch (const rpc::RpcError& e) {
        EXPECT_EQ(e.code(), rpc::ErrorCode::kResourceExhausted) << e.what();
        EXPECT_NE(std::string(e.what()).find("set_max_remote_context_bytes"), std::string::npos)
            << e.what();
      }
    }
    // The release rides in a later call; then the bytes are free again.
    const absl::Time until = absl::Now() + absl::Seconds(20);
    int64_t held = -1;
    while ((held = rpc::rpc_sync<int64_t>("worker1", "set_max_remote_bytes", int64_t{1} << 20)) > 0 &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(held, 0);
    {
      dist_autograd::Context context;
      for (int i = 0; i < 4; ++i) rpc::rpc_sync<at::Tensor>("worker1", "square", x);
    }
    rpc::rpc_sync<int64_t>("worker1", "set_max_remote_bytes", int64_t{4} << 30);
  }
  rpc::shutdown();
}

// A worker that keeps its contexts alive takes only its share of the bytes
// (counted by the worker whose messages brought them): another worker's
// tensors are still taken.
MULTIPROCESS_TEST(DistAutogradHostileTest, AWorkerThatKeepsItsContextsTakesOnlyItsShare, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  rpc::Store& store = rpc::current_agent()->store();
  const at::Tensor x = at::ones({(256 << 10) / 4}).requires_grad_();  // 256 KiB
  const int64_t kMiB = 1 << 20;
  if (mp::rank() == 0) {
    ASSERT_EQ(rpc::rpc_sync<int64_t>("worker2", "set_remote_bounds", kMiB, kMiB / 2, int64_t{0}), 0);
    {
      dist_autograd::Context hog;  // alive until worker1 is done
      int taken = 0;
      for (int i = 0; i < 4; ++i) {
        try {
          rpc::rpc_sync<at::Tensor>("worker2", "square", x);
          ++taken;
        } catch (const rpc::RpcError& e) {
          EXPECT_EQ(e.code(), rpc::ErrorCode::kResourceExhausted) << e.what();
          EXPECT_NE(std::string(e.what()).find("messages of worker 0"), std::string::npos)
              << e.what();
        }
      }
      EXPECT_EQ(taken, 2) << "worker0's messages brought " << taken
                          << " x 256 KiB of a 512 KiB share";
      store.set("hogged", "1");
      store.get("worker1_done");
    }
    // The release rides in a later call: then the share is free again.
    const absl::Time until = absl::Now() + absl::Seconds(20);
    int64_t held = -1;
    while ((held = rpc::rpc_sync<int64_t>("worker2", "set_remote_bounds", kMiB, kMiB / 2,
                                          int64_t{0})) > 0 &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(held, 0);
    rpc::rpc_sync<int64_t>("worker2", "set_remote_bounds", int64_t{4} << 30, int64_t{1} << 30,
                           int64_t{0});
    store.set("restored", "1");
  } else if (mp::rank() == 1) {
    store.get("hogged");
    {
      dist_autograd::Context mine;
      for (int i = 0; i < 2; ++i) {
        EXPECT_NO_THROW(rpc::rpc_sync<at::Tensor>("worker2", "square", x))
            << "worker1's message " << i << " was refused while worker0 holds its share";
      }
    }
    store.set("worker1_done", "1");
  }
  store.get("restored");
  rpc::shutdown();
}

// One worker's messages make at most a quarter of the 65,536 contexts that
// other workers' messages may keep alive here: past it only that worker's
// new contexts are refused, and another worker's still come.
MULTIPROCESS_TEST(DistAutogradHostileTest, AWorkerMakesOnlyItsShareOfContextsHere, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  rpc::Store& store = rpc::current_agent()->store();
  constexpr int kShare = (1 << 16) / 4;
  if (mp::rank() == 0) {
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "contexts_here");
    std::vector<std::unique_ptr<dist_autograd::Context>> alive;
    alive.reserve(kShare + 1);
    std::vector<rpc::Future<int64_t>> calls;
    calls.reserve(kShare);
    for (int i = 0; i < kShare; ++i) {
      alive.push_back(std::make_unique<dist_autograd::Context>());
      // Each brings its context there.
      calls.push_back(rpc::rpc_async<int64_t>("worker1", "contexts_here"));
    }
    for (auto& call : calls) call.value();
    alive.push_back(std::make_unique<dist_autograd::Context>());
    try {
      rpc::rpc_sync<int64_t>("worker1", "contexts_here");
      ADD_FAILURE() << "worker0's messages kept " << kShare + 1 << " contexts alive on worker1";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kResourceExhausted) << e.what();
      EXPECT_NE(std::string(e.what()).find("messages of worker 0"), std::string::npos) << e.what();
    }
    store.set("share_used", "1");
    store.get("worker2_done");
    while (!alive.empty()) alive.pop_back();  // innermost first
    // Their releases ride in later calls, and the flusher's.
    const absl::Time until = absl::Now() + absl::Seconds(60);
    int64_t now = -1;
    std::thread([&] {
      while ((now = rpc::rpc_sync<int64_t>("worker1", "contexts_here")) > before &&
             absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(50));
      }
    }).join();
    EXPECT_EQ(now, before);
    store.set("released", "1");
  } else if (mp::rank() == 2) {
    store.get("share_used");
    {
      dist_autograd::Context mine;
      EXPECT_NO_THROW(rpc::rpc_sync<int64_t>("worker1", "contexts_here"))
          << "worker2's context was refused while worker0 holds its share";
    }
    store.set("worker2_done", "1");
  }
  store.get("released");
  rpc::shutdown();
}

// A message refused as it joins a context it brings here first leaves no
// context behind: one with a malformed message id, and one whose tensors
// pass the byte bound.
MULTIPROCESS_TEST(DistAutogradHostileTest, ARefusedMessageLeavesNoContext, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "contexts_here");
    // A context id worker 0 could have made, never used before.
    const int64_t fresh = (int64_t{0} << 48) | 424242;
    auto malformed = rpc::testing::request_frame(0, 1, "square", {at::ones({2})});
    add_ext(&malformed, "dist_autograd.context", absl::StrCat(fresh));
    add_ext(&malformed, "dist_autograd.message", "not a number");
    expect_error(raw_call("worker1", 0, malformed), rpc::ErrorCode::kMalformedMessage,
                 "malformed message id");
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before)
        << "the malformed message left its context";

    ASSERT_EQ(rpc::rpc_sync<int64_t>("worker1", "set_max_remote_bytes", int64_t{1} << 20), 0);
    // Asked from a thread outside the context: a call inside it brings it.
    auto contexts_there = [] {
      int64_t n = -1;
      std::thread([&n] { n = rpc::rpc_sync<int64_t>("worker1", "contexts_here"); }).join();
      return n;
    };
    {
      dist_autograd::Context context;
      const at::Tensor big = at::ones({(2 << 20) / 4}).requires_grad_();  // 2 MiB
      try {
        rpc::rpc_sync<at::Tensor>("worker1", "square", big);
        ADD_FAILURE() << "2 MiB taken past a 1 MiB bound";
      } catch (const rpc::RpcError& e) {
        EXPECT_EQ(e.code(), rpc::ErrorCode::kResourceExhausted) << e.what();
      }
      EXPECT_EQ(contexts_there(), before) << "the refused message left its context";
      // The context may still come with a message that fits.
      rpc::rpc_sync<at::Tensor>("worker1", "square", at::ones({2}).requires_grad_());
      EXPECT_EQ(contexts_there(), before + 1);
    }
    rpc::rpc_sync<int64_t>("worker1", "set_max_remote_bytes", int64_t{4} << 30);
  }
  rpc::shutdown();
}

// A reply carrying a context that arrives after its creator left the
// context does not create it again (it would never be freed).
MULTIPROCESS_TEST(DistAutogradHostileTest, LateReplyDoesNotRecreateALeftContext, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    ASSERT_EQ(dist_autograd::num_contexts(), 0u);
    const int64_t before = rpc::rpc_sync<int64_t>("worker1", "contexts_here");
    rpc::Future<int64_t> in_flight;
    rpc::RRef<at::Tensor> outer;
    {
      dist_autograd::Context context;
      in_flight = rpc::rpc_async<int64_t>("worker1", "sleep_ms", 200);
      outer = rpc::remote<at::Tensor>("worker1", "square", at::ones({2}));
      // Declared after the context, so destroyed first: its delete goes out
      // inside the context.
      rpc::RRef<at::Tensor> inner = rpc::remote<at::Tensor>("worker1", "square", at::ones({2}));
      EXPECT_TRUE(at::allclose(inner.to_here(), at::ones({2})));
    }  // left before these replies
    outer = rpc::RRef<at::Tensor>();  // its delete is answered after the context ended
    EXPECT_EQ(in_flight.value(), 200);
    absl::SleepFor(absl::Milliseconds(200));  // the deletes' replies
    EXPECT_EQ(dist_autograd::num_contexts(), 0u);
    // The callee's copy of the context is released too.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (rpc::rpc_sync<int64_t>("worker1", "contexts_here") > before && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "contexts_here"), before);
  }
  rpc::shutdown();
}

// The thread that sends context releases survives an exception, and the
// releases it held go out on its next round.
MULTIPROCESS_TEST(DistAutogradHostileTest, ReleaseFlusherSurvivesAnException, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  rpc::Store& store = rpc::current_agent()->store();
  if (mp::rank() == 0) {
    rpc::internal::arm_fault("dist_autograd.flush");
    {
      dist_autograd::Context context;
      rpc::rpc_sync<at::Tensor>("worker1", "square", at::ones({2}).requires_grad_(true));
    }  // its release waits for the flusher (no other call goes to worker1)
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (rpc::internal::fault_count("dist_autograd.flush") == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(rpc::internal::fault_count("dist_autograd.flush"), 1);
    store.set("left", "1");
    store.get("released");
  } else {
    store.get("left");
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (dist_autograd::num_contexts() > 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(dist_autograd::num_contexts(), 0u);
    store.set("released", "1");
  }
  rpc::shutdown();
}

}  // namespace
