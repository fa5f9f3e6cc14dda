// Every failure of an RPC surfaces as an RpcError naming the worker and the
// function, within bounded time: bad calls, remote exceptions, timeouts,
// oversized messages, malformed bytes, dead peers, shutdown.
#include <ATen/ops/ones.h>
#include <grpcpp/grpcpp.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "rpc/rref/rref.h"
#include "rpc/testing/raw_peer.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) { return a.add(b); }
DDPRPC_REGISTER_FUNCTION(add);

int64_t boom(int64_t) { throw std::runtime_error("kaboom"); }
DDPRPC_REGISTER_FUNCTION(boom);

std::atomic<bool> g_sleeping{false};
int64_t sleep_ms(int64_t ms) {
  g_sleeping = true;
  absl::SleepFor(absl::Milliseconds(ms));
  return ms;
}
DDPRPC_REGISTER_FUNCTION(sleep_ms);
bool is_sleeping() { return g_sleeping.load(); }
DDPRPC_REGISTER_FUNCTION(is_sleeping);

at::Tensor make_tensor(int64_t numel) { return at::ones({numel}); }
DDPRPC_REGISTER_FUNCTION(make_tensor);

// rpc::shutdown from a request handler: what it says.
std::string shutdown_here() {
  try {
    rpc::shutdown();
    return "shut down";
  } catch (const std::exception& e) {
    return e.what();
  }
}
DDPRPC_REGISTER_FUNCTION(shutdown_here);


// Runs `fn`, expecting an RpcError with `code` whose message has every one
// of `needles`.
template <typename F>
void expect_rpc_error(F fn, rpc::ErrorCode code, std::vector<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected " << rpc::error_code_name(code);
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' missing from: " << e.what();
    }
  }
}

MULTIPROCESS_TEST(RpcErrorsTest, BadCallsGetClearErrors, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.max_message_bytes = 1 << 20;
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, options);
  if (mp::rank() == 0) {
    at::Tensor t = at::ones({2});
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "no_such_fn", t); },
                     rpc::ErrorCode::kUnknownFunction, {"no_such_fn", "worker1"});
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "add", "text", t); },
                     rpc::ErrorCode::kInvalidArgument,
                     {"argument 1 of 'add'", "expected Tensor, got str", "worker1"});
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "add", t); },
                     rpc::ErrorCode::kInvalidArgument, {"takes 2 arguments, got 1"});
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "boom", 1); },
                     rpc::ErrorCode::kRemoteException, {"kaboom", "'boom'", "worker1"});
    expect_rpc_error([&] { rpc::rpc_sync<std::string>("worker1", "add", t, t); },
                     rpc::ErrorCode::kInvalidArgument, {"unexpected result type"});
    expect_rpc_error([&] { rpc::rpc_sync("nobody", "add", t, t); },
                     rpc::ErrorCode::kInvalidArgument, {"unknown worker 'nobody'"});
    // Oversized request (caught before sending) and oversized reply.
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "add", at::ones({1 << 19}), t); },
                     rpc::ErrorCode::kMessageTooLarge, {"max_message_bytes", "'add'"});
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "make_tensor", 1 << 19); },
                     rpc::ErrorCode::kMessageTooLarge, {"make_tensor", "worker1"});
    // Errors fail the future of rpc_async the same way.
    auto f = rpc::rpc_async("worker1", "boom", 2);
    EXPECT_TRUE(f.wait_for(absl::Seconds(10)));
    EXPECT_TRUE(f.has_error());
    // The connection survives all of this.
    EXPECT_EQ(rpc::rpc_sync<at::Tensor>("worker1", "add", t, t)[0].item<float>(), 2.0f);
  }
  rpc::shutdown();
  expect_rpc_error([&] { rpc::rpc_sync("worker0", "add", at::ones({1}), at::ones({1})); },
                   rpc::ErrorCode::kShutdown, {"init_rpc"});
  EXPECT_TRUE(rpc::rpc_async("worker0", "add", 1, 2).has_error());
}

MULTIPROCESS_TEST(RpcErrorsTest, TimeoutFailsTheCallNotTheConnection, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.rpc_timeout = absl::Milliseconds(300);  // default for every call
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, options);
  if (mp::rank() == 0) {
    absl::Time start = absl::Now();
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "sleep_ms", 3000); },
                     rpc::ErrorCode::kTimeout, {"timed out", "sleep_ms", "worker1"});
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    start = absl::Now();
    expect_rpc_error(
        [&] { rpc::rpc_sync(rpc::CallOptions{absl::Milliseconds(50)}, "worker1", "sleep_ms", 3000); },
        rpc::ErrorCode::kTimeout, {"timed out"});
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
    // A per-call timeout can also extend the default.
    EXPECT_EQ(rpc::rpc_sync<int64_t>(rpc::CallOptions{absl::Seconds(10)}, "worker1", "sleep_ms", 500), 500);
    // The default changes at run time, for the calls made after.
    EXPECT_EQ(rpc::get_rpc_timeout(), absl::Milliseconds(300));
    rpc::set_rpc_timeout(absl::Seconds(10));
    EXPECT_EQ(rpc::get_rpc_timeout(), absl::Seconds(10));
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "sleep_ms", 500), 500);
    rpc::set_rpc_timeout(absl::Milliseconds(100));
    start = absl::Now();
    expect_rpc_error([&] { rpc::rpc_sync("worker1", "sleep_ms", 3000); },
                     rpc::ErrorCode::kTimeout, {"timed out", "default rpc_timeout is 100ms"});
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
    // remote() under its own timeout: shorter or longer than the default.
    rpc::set_rpc_timeout(absl::Seconds(10));
    start = absl::Now();
    auto slow = rpc::remote<int64_t>(rpc::CallOptions{absl::Milliseconds(100)}, "worker1",
                                     "sleep_ms", 3000);
    // The creation's outcome (its timeout) is known within about 100 ms.
    while (!slow.confirmed_by_owner() && absl::Now() - start < absl::Seconds(2)) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
    expect_rpc_error([&] { slow.to_here(); }, rpc::ErrorCode::kTimeout, {"timed out", "sleep_ms"});
    rpc::set_rpc_timeout(absl::Milliseconds(100));
    auto patient = rpc::remote<int64_t>(rpc::CallOptions{absl::Seconds(10)}, "worker1",
                                        "sleep_ms", 500);
    EXPECT_EQ(patient.to_here(absl::Seconds(10)), 500);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcErrorsTest, KilledPeerFailsPendingCallsFast, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());  // default timeout: 60 s
  if (mp::rank() == 1) {
    while (!g_sleeping) absl::SleepFor(absl::Milliseconds(5));
    mp::die_abruptly();  // in the middle of serving sleep_ms (it set g_sleeping)
  }
  if (mp::rank() == 0) {
    absl::Time start = absl::Now();
    auto pending = rpc::rpc_async<int64_t>("worker1", "sleep_ms", 30000);
    ASSERT_TRUE(pending.wait_for(absl::Seconds(20)));
    try {
      pending.value();
      ADD_FAILURE() << "the call to a killed worker succeeded";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find("worker1"), std::string::npos) << e.what();
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    // New calls to the dead worker fail too; the others still work.
    auto again = rpc::rpc_async<int64_t>("worker1", "sleep_ms", 1);
    ASSERT_TRUE(again.wait_for(absl::Seconds(20)));
    EXPECT_TRUE(again.has_error());
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker2", "sleep_ms", 1), 1);
    // Calling it again and again opens a stream each time; the broken ones
    // that have ended are let go, not kept until shutdown.
    for (int i = 0; i < 200; ++i) {
      auto call = rpc::rpc_async<int64_t>("worker1", "sleep_ms", 1);
      call.wait_for(absl::Seconds(20));
      EXPECT_TRUE(call.has_error());
    }
    const auto info = rpc::current_agent()->debug_info();
    ASSERT_TRUE(info.count("agent.broken_streams"));
    EXPECT_LT(std::stoi(info.at("agent.broken_streams")), 20);
  }
  absl::Time start = absl::Now();
  // Does not wait for the dead worker, and says it did not meet everyone.
  EXPECT_FALSE(rpc::shutdown());
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// A peer that stops (SIGSTOP: its port still accepts connections, nothing
// answers) is found by keepalive within seconds: a call waiting on it fails
// naming the worker and the function, and a worker with only an idle
// connection to it marks it unreachable. Once it resumes, it serves again.
MULTIPROCESS_TEST(RpcErrorsTest, KeepaliveFindsAStoppedPeer, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.keepalive_interval = absl::Milliseconds(500);
  options.keepalive_timeout = absl::Milliseconds(1500);
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, options);
  auto agent = rpc::current_agent();
  rpc::Store& store = agent->store();
  if (mp::rank() == 1) {
    store.set("pid1", std::to_string(::getpid()));
    store.get("resumed");  // stopped and continued meanwhile
  }
  if (mp::rank() == 2) {
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "sleep_ms", 1), 1);  // an idle connection
    store.set("connected", "1");
    store.get("stopped");
    const absl::Time start = absl::Now();
    while (agent->is_reachable(1) && absl::Now() - start < absl::Seconds(15)) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_FALSE(agent->is_reachable(1));
    EXPECT_LT(absl::Now() - start, absl::Seconds(8));
    store.set("noticed", "1");
  }
  if (mp::rank() == 0) {
    const pid_t pid = std::stoi(store.get("pid1"));
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "sleep_ms", 1), 1);
    store.get("connected");
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    store.set("stopped", "1");
    const absl::Time start = absl::Now();
    auto f = rpc::rpc_async<int64_t>(rpc::CallOptions{absl::Seconds(60)}, "worker1", "sleep_ms", 5);
    ASSERT_TRUE(f.wait_for(absl::Seconds(30)));
    EXPECT_LT(absl::Now() - start, absl::Seconds(8));
    try {
      f.value();
      ADD_FAILURE() << "a call to a stopped worker succeeded";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find("'sleep_ms') on worker 'worker1'"), std::string::npos)
          << e.what();
    }
    store.get("noticed");
    ASSERT_EQ(::kill(pid, SIGCONT), 0);
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "sleep_ms", 2), 2);  // reconnects
    EXPECT_TRUE(agent->is_reachable(1));
    store.set("resumed", "1");
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcErrorsTest, GracefulShutdownWaitsForCallsInFlight, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  std::vector<rpc::Future<int64_t>> futures;
  if (mp::rank() == 0) {
    for (int i = 0; i < 20; ++i) futures.push_back(rpc::rpc_async<int64_t>("worker1", "sleep_ms", 100));
  }
  rpc::shutdown();  // worker1 keeps serving until worker0 is done
  for (auto& f : futures) {
    ASSERT_TRUE(f.completed());
    EXPECT_EQ(f.value(), 100);
  }
}

// A call without a deadline does not hold a graceful shutdown beyond the
// RPC timeout: it fails with SHUTDOWN. (Rank 0, which hosts the store, also
// waits for the others to leave; the caller here is rank 1.)
MULTIPROCESS_TEST(RpcErrorsTest, GracefulShutdownFailsCallsWithoutADeadline, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.rpc_timeout = absl::Seconds(1);
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, options);
  if (mp::rank() == 1) {
    auto f = rpc::rpc_async<int64_t>(rpc::CallOptions{absl::ZeroDuration()}, "worker2", "sleep_ms",
                                     4000);
    const absl::Time start = absl::Now();
    rpc::shutdown();
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
    ASSERT_TRUE(f.completed());
    EXPECT_TRUE(f.has_error());
    EXPECT_NE(f.error_message().find("shut down"), std::string::npos) << f.error_message();
    EXPECT_NE(f.error_message().find("'sleep_ms') on worker 'worker2'"), std::string::npos)
        << f.error_message();
  } else {
    rpc::shutdown();
  }
}

MULTIPROCESS_TEST(RpcErrorsTest, UngracefulShutdownFailsCallsInFlight, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    auto f = rpc::rpc_async<int64_t>("worker1", "sleep_ms", 2000);
    // The call is running on worker1 (not merely sent) when we shut down.
    while (!f.completed() && !rpc::rpc_sync<bool>("worker1", "is_sleeping")) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_FALSE(f.completed()) << "the 2 s call ended before the shutdown";
    absl::Time start = absl::Now();
    rpc::shutdown(/*graceful=*/false);
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
    ASSERT_TRUE(f.completed());
    EXPECT_TRUE(f.has_error());
    EXPECT_NE(f.error_message().find("shut down"), std::string::npos) << f.error_message();
  } else {
    absl::SleepFor(absl::Milliseconds(500));
    rpc::shutdown(/*graceful=*/false);
  }
}

// A callback of a call that timed out runs on the agent's timer thread; if
// it waits for another call, that call (and every other) still times out:
// a waiter fails its call at the deadline itself.
MULTIPROCESS_TEST(RpcErrorsTest, ACallbackWaitingOnACallDoesNotStopTimeouts, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    absl::Notification nested_done;
    std::string nested_error;
    auto first = rpc::rpc_async<int64_t>(rpc::CallOptions{absl::Milliseconds(100)}, "worker1",
                                         "sleep_ms", 500);
    first.add_done_callback([&](const rpc::Future<int64_t>&) {
      try {
        rpc::rpc_sync<int64_t>(rpc::CallOptions{absl::Milliseconds(200)}, "worker1", "sleep_ms",
                               2000);
      } catch (const std::exception& e) {
        nested_error = e.what();
      }
      nested_done.Notify();
    });
    const absl::Time start = absl::Now();
    auto other = rpc::rpc_async<int64_t>(rpc::CallOptions{absl::Milliseconds(300)}, "worker1",
                                         "sleep_ms", 5000);
    EXPECT_TRUE(other.wait_for(absl::Seconds(5))) << "a call outlived its timeout";
    EXPECT_TRUE(other.has_error());
    EXPECT_TRUE(nested_done.WaitForNotificationWithTimeout(absl::Seconds(5)))
        << "the callback's call never timed out";
    EXPECT_NE(nested_error.find("timed out"), std::string::npos) << nested_error;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  rpc::shutdown();
}

// A thread still in a store call (a barrier waiting for a worker that never
// comes) when another shuts the agent down fails there, with an error; and
// a second shutdown at the same time returns at once.
MULTIPROCESS_TEST(RpcErrorsTest, ShutdownWhileAnotherThreadWaitsInABarrier, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    std::atomic<bool> threw{false};
    std::thread waiter([&threw] {
      try {
        rpc::barrier({"worker0", "worker1"}, absl::Seconds(10));
      } catch (const std::exception&) {
        threw = true;
      }
    });
    absl::SleepFor(absl::Milliseconds(300));
    std::thread second([] { rpc::shutdown(/*graceful=*/false); });
    rpc::shutdown(/*graceful=*/false);
    second.join();
    waiter.join();
    EXPECT_TRUE(threw.load()) << "a barrier missing a worker succeeded";
  } else {
    absl::SleepFor(absl::Milliseconds(600));
    rpc::shutdown(/*graceful=*/false);
  }
}

// rpc::shutdown() from a request handler (one of the agent's own threads,
// which shutdown would wait for) is refused with an error, not a hang or
// an abort.
MULTIPROCESS_TEST(RpcErrorsTest, ShutdownFromAHandlerIsRefused, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    const std::string said =
        rpc::rpc_sync<std::string>(rpc::CallOptions{absl::Seconds(20)}, "worker1", "shutdown_here");
    EXPECT_NE(said.find("cannot run on one of its agent's threads"), std::string::npos) << said;
  }
  rpc::shutdown();
}

// A stream that sends garbage is cut off with a clear status; the worker
// keeps serving everyone else (hostile_input_test has the other cases).
MULTIPROCESS_TEST(RpcErrorsTest, MalformedBytesEndOnlyTheirStream, 1) {
  rpc::init_rpc("solo", 0, 1, mp::backend_options());
  rpc::testing::RawStream stream(rpc::get_worker_info().address, rpc::get_worker_info().id, 0,
                                 absl::Seconds(10));
  stream.write_bytes(std::string("\x10\x00\x00\x00not a frame at all", 22));
  EXPECT_FALSE(stream.read().has_value());
  grpc::Status status = stream.finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("malformed frame"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(rpc::rpc_sync<int64_t>("solo", "sleep_ms", 1), 1);
  rpc::shutdown();
}

TEST(RpcErrorsTest, InitErrorsAreClear) {
  if (mp::is_worker()) return;
  expect_rpc_error([] { rpc::RpcAgent("x", 3, 2, {}); }, rpc::ErrorCode::kInvalidArgument,
                   {"invalid rank 3"});
  rpc::RpcBackendOptions bad = mp::backend_options();
  bad.init_method = "udp://nowhere";
  expect_rpc_error([&] { rpc::RpcAgent("x", 0, 1, bad); }, rpc::ErrorCode::kInvalidArgument,
                   {"unsupported init_method"});
  rpc::RpcBackendOptions no_handoff = mp::backend_options();
  no_handoff.inline_request_handoff = absl::ZeroDuration();
  expect_rpc_error([&] { rpc::RpcAgent("x", 0, 1, no_handoff); },
                   rpc::ErrorCode::kInvalidArgument, {"inline_request_handoff must be above zero"});
}

}  // namespace
