// Multi-process tests of the RPC runtime: every MULTIPROCESS_TEST runs as
// real processes on loopback (tests/multiprocess.h).
#include "rpc/rpc.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>

#include <sched.h>

#include <atomic>
#include <map>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/store.h"
#include "rpc/rref/rref.h"
#include "tests/multiprocess.h"

namespace rpc = ddprpc::rpc;
namespace mp = ddprpc::testing;

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add);

int64_t add_ints(int64_t a, int64_t b) { return a + b; }
DDPRPC_REGISTER_FUNCTION(add_ints);

at::Tensor identity(at::Tensor t) { return t; }
DDPRPC_REGISTER_FUNCTION(identity);

std::string whoami(std::string prefix) {
  return prefix + rpc::get_worker_info().name + " called by " +
         rpc::get_worker_info().name.substr(0, 0) +
         rpc::current_agent()->worker(rpc::current_call()->caller).name;
}
DDPRPC_REGISTER_FUNCTION(whoami);

std::tuple<int64_t, std::vector<double>, bool> mixed(std::vector<int64_t> xs, std::string s) {
  int64_t sum = 0;
  for (auto x : xs) sum += x;
  return {sum, {0.5, static_cast<double>(s.size())}, s.empty()};
}
DDPRPC_REGISTER_FUNCTION(mixed);

// Nested RPC: the callee calls a third worker.
at::Tensor relay(std::string to, at::Tensor t) { return rpc::rpc_sync<at::Tensor>(to, "add", t, t); }
DDPRPC_REGISTER_FUNCTION(relay);

// A three-worker cycle through async execution (see the test below):
// bounce on A calls relay_async on B, which calls async_add back on A, whose
// reply waits for `to`'s answer. Timeouts of 5 s turn a hang into an error.
constexpr absl::Duration kCycleTimeout = absl::Seconds(5);
rpc::Future<at::Tensor> async_add(std::string to, at::Tensor t) {
  return rpc::rpc_async<at::Tensor>(rpc::CallOptions{kCycleTimeout}, to, "add", t, t);
}
DDPRPC_REGISTER_FUNCTION(async_add);
at::Tensor relay_async(std::string via, std::string to, at::Tensor t) {
  return rpc::rpc_sync<at::Tensor>(rpc::CallOptions{kCycleTimeout}, via, "async_add", to, t);
}
DDPRPC_REGISTER_FUNCTION(relay_async);
at::Tensor bounce(std::string b, std::string a, std::string c, at::Tensor t) {
  return rpc::rpc_sync<at::Tensor>(rpc::CallOptions{kCycleTimeout}, b, "relay_async", a, c, t);
}
DDPRPC_REGISTER_FUNCTION(bounce);

// Batch-updating parameter server (update_and_fetch_model): each
// caller adds its gradient and yields its thread; the last one completes the
// shared future, which answers everyone.
struct BatchServer {
  absl::Mutex mu;
  rpc::Future<at::Tensor> future ABSL_GUARDED_BY(mu);
  at::Tensor sum ABSL_GUARDED_BY(mu);
  int64_t arrived ABSL_GUARDED_BY(mu) = 0;
};
BatchServer& batch_server() {
  static auto* s = new BatchServer();
  return *s;
}
rpc::Future<at::Tensor> update_and_fetch(at::Tensor grad, int64_t batch_size) {
  BatchServer& s = batch_server();
  rpc::Future<at::Tensor> mine, done;
  at::Tensor result;
  {
    absl::MutexLock lock(&s.mu);
    mine = s.future;
    s.sum = s.arrived == 0 ? grad.clone() : s.sum + grad;
    if (++s.arrived == batch_size) {
      s.arrived = 0;
      result = s.sum;
      done = s.future;
      s.future = rpc::Future<at::Tensor>();
    }
  }
  if (result.defined()) done.set_result(result);
  return mine;
}
DDPRPC_REGISTER_FUNCTION(update_and_fetch);

// Async execution whose reply waits for a later request of the same caller:
// `await_release` returns a future that `release_awaiting` completes.
rpc::Future<bool>& awaited() {
  static auto* f = new rpc::Future<bool>();
  return *f;
}
rpc::Future<bool> await_release() { return awaited(); }
DDPRPC_REGISTER_FUNCTION(await_release);
void release_awaiting() { awaited().set_result(true); }
DDPRPC_REGISTER_FUNCTION(release_awaiting);
void reset_awaited() { awaited() = rpc::Future<bool>(); }
DDPRPC_REGISTER_FUNCTION(reset_awaited);

// Completes `await_release`'s future (its reply is held until this handler
// returns or waits), then waits for `ack`, which the caller sends only once
// that reply has reached it: true when acknowledged, false after 10 s.
rpc::Future<void>& acked() {
  static auto* f = new rpc::Future<void>();
  return *f;
}
bool release_then_await_ack() {
  awaited().set_result(true);
  return acked().wait_for(absl::Seconds(10));
}
DDPRPC_REGISTER_FUNCTION(release_then_await_ack);
void ack() { acked().set_result(); }
DDPRPC_REGISTER_FUNCTION(ack);

std::atomic<int> g_busy_seen{0};
int64_t busy_threads() { return rpc::current_agent()->busy_worker_threads(); }
DDPRPC_REGISTER_FUNCTION(busy_threads);

// A callee function that blocks until a later request of the same caller
// arrives (on the same stream): true when signalled, false after 20 s.
absl::Notification& signal_note() {
  static auto* n = new absl::Notification();
  return *n;
}
bool wait_for_signal() { return signal_note().WaitForNotificationWithTimeout(absl::Seconds(20)); }
DDPRPC_REGISTER_FUNCTION(wait_for_signal);
void send_signal() { signal_note().Notify(); }
DDPRPC_REGISTER_FUNCTION(send_signal);

// An async call that stays in flight, holding no thread, until unpark().
rpc::Future<int64_t>& parked() {
  static auto* f = new rpc::Future<int64_t>();
  return *f;
}
rpc::Future<int64_t> park() { return parked(); }
DDPRPC_REGISTER_FUNCTION(park);
void unpark() {  // one unpark per park in these tests
  if (!parked().completed()) parked().set_result(int64_t{1});
}
DDPRPC_REGISTER_FUNCTION(unpark);
void rearm_park() { parked() = rpc::Future<int64_t>(); }
DDPRPC_REGISTER_FUNCTION(rearm_park);

// Returns whether another wait_for_partner call ran at the same time,
// waiting at most `timeout_ms` for it.
bool wait_for_partner(int64_t timeout_ms) {
  static absl::Mutex mu;
  static int arrived = 0;
  absl::MutexLock lock(&mu);
  ++arrived;
  auto met = [] { return arrived >= 2; };
  return mu.AwaitWithTimeout(absl::Condition(&met), absl::Milliseconds(timeout_ms));
}
DDPRPC_REGISTER_FUNCTION(wait_for_partner);

void init(int world_size, rpc::RpcBackendOptions options = mp::backend_options()) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), world_size, std::move(options));
}

MULTIPROCESS_TEST(RpcTest, SyncAndAsyncAmongThreeWorkers, 3) {
  init(3);
  EXPECT_EQ(rpc::get_worker_info().name, mp::worker_name());
  EXPECT_EQ(rpc::get_worker_info().id, mp::rank());
  ASSERT_EQ(rpc::get_worker_infos().size(), 3u);
  for (int peer = 0; peer < 3; ++peer) {
    const std::string to = mp::worker_name(peer);
    EXPECT_EQ(rpc::get_worker_info(to).id, peer);
    at::Tensor x = at::full({4}, mp::rank() + 1.0);
    EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>(to, "add", x, x), x * 2));
    rpc::Future<int64_t> f = rpc::rpc_async<int64_t>(to, "add_ints", peer, 100);
    EXPECT_EQ(f.value(), peer + 100);
    // The callee by rank or by WorkerInfo, as by name.
    EXPECT_EQ(rpc::rpc_sync<int64_t>(peer, "add_ints", peer, 1), peer + 1);
    EXPECT_EQ(rpc::rpc_async<int64_t>(rpc::get_worker_info(to), "add_ints", peer, 2).value(), peer + 2);
    EXPECT_EQ(rpc::remote<int64_t>(peer, "add_ints", peer, 3).to_here(), peer + 3);
    EXPECT_EQ(rpc::rpc_sync<std::string>(to, "whoami", "I am "),
              "I am " + to + " called by " + mp::worker_name());
    auto [sum, doubles, empty] = rpc::rpc_sync<std::tuple<int64_t, std::vector<double>, bool>>(
        to, "mixed", std::vector<int64_t>{1, 2, 3}, "abc");
    EXPECT_EQ(sum, 6);
    EXPECT_EQ(doubles, (std::vector<double>{0.5, 3.0}));
    EXPECT_FALSE(empty);
  }
  // Unknown ranks and a WorkerInfo whose name and id disagree are refused.
  EXPECT_THROW(rpc::rpc_sync<int64_t>(3, "add_ints", 1, 2), rpc::RpcError);
  EXPECT_TRUE(rpc::rpc_async<int64_t>(-1, "add_ints", 1, 2).has_error());
  rpc::WorkerInfo wrong = rpc::get_worker_info("worker1");
  wrong.id = 2;
  EXPECT_THROW(rpc::rpc_sync<int64_t>(wrong, "add_ints", 1, 2), rpc::RpcError);
  EXPECT_TRUE(rpc::shutdown());  // met every worker
  EXPECT_FALSE(rpc::shutdown());  // nothing left to shut down
}

// The scheduling policy of the thread that runs a request.
int64_t handler_policy() { return sched_getscheduler(0); }
DDPRPC_REGISTER_FUNCTION(handler_policy);

// Requests run on the runtime's threads, SCHED_BATCH unless the worker
// switched batch_scheduling off; the caller's own thread keeps its policy.
MULTIPROCESS_TEST(RpcTest, RequestsRunOnBatchScheduledThreadsUnlessSwitchedOff, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.batch_scheduling = mp::rank() != 2;
  init(3, options);
  if (mp::rank() == 0) {
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(rpc::rpc_sync<int64_t>("worker1", "handler_policy"), SCHED_BATCH);
      EXPECT_EQ(rpc::rpc_sync<int64_t>("worker2", "handler_policy"), SCHED_OTHER);
      // Several at once: some run on the worker pool.
      std::vector<rpc::Future<int64_t>> on1, on2;
      for (int j = 0; j < 4; ++j) {
        on1.push_back(rpc::rpc_async<int64_t>("worker1", "handler_policy"));
        on2.push_back(rpc::rpc_async<int64_t>("worker2", "handler_policy"));
      }
      for (auto& f : on1) EXPECT_EQ(f.value(), SCHED_BATCH);
      for (auto& f : on2) EXPECT_EQ(f.value(), SCHED_OTHER);
    }
    EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);
  }
  rpc::shutdown();
}

// A call waited for within a SyncCallScope (as rpc_sync) has its reply read
// by the waiting thread: callbacks chained on it run there, not on a reader.
// (The queue's background reader may still hold the role when a scope
// starts, e.g. for the last call's write completion, and then hands it over
// after one event; with a reader thread, none would run on the caller.)
MULTIPROCESS_TEST(RpcTest, WaitingCallerReadsItsOwnReply, 2) {
  init(2);
  if (mp::rank() == 0) {
    int on_caller = 0;
    for (int i = 0; i < 20; ++i) {
      std::thread::id ran_on;
      rpc::SyncCallScope waits_here;
      rpc::Future<int64_t> sum = rpc::rpc_async<int64_t>("worker1", "add_ints", i, 1);
      rpc::Future<int64_t> chained = sum.then([&ran_on](const rpc::Future<int64_t>& f) {
        ran_on = std::this_thread::get_id();
        return f.value();
      });
      EXPECT_EQ(chained.value(), i + 1);
      if (ran_on == std::this_thread::get_id()) ++on_caller;
    }
    EXPECT_GE(on_caller, 15);
  }
  rpc::shutdown();
}

// A scope whose call's future is dropped unwaited holds the background
// reader off only until it ends: then replies nobody waits for (a callback
// only) are read, and later calls complete.
MULTIPROCESS_TEST(RpcTest, DroppedWaitDoesNotStallTheStream, 2) {
  init(2);
  if (mp::rank() == 0) {
    auto called_back = std::make_shared<absl::Notification>();
    {
      rpc::SyncCallScope waits_here;
      rpc::rpc_async<int64_t>("worker1", "add_ints", 1, 2);  // dropped unwaited
    }
    rpc::rpc_async<int64_t>("worker1", "add_ints", 3, 4)
        .add_done_callback([called_back](const rpc::Future<int64_t>&) { called_back->Notify(); });
    EXPECT_TRUE(called_back->WaitForNotificationWithTimeout(absl::Seconds(10)))
        << "a reply nobody waits for was never read";
    for (int i = 0; i < 5; ++i) {
      rpc::Future<int64_t> f = rpc::rpc_async<int64_t>("worker1", "add_ints", i, 10);
      ASSERT_TRUE(f.wait_for(absl::Seconds(10))) << "call " << i << " never completed";
      EXPECT_EQ(f.value(), i + 10);
    }
  }
  rpc::shutdown();
}

// All of a process's streams share one completion queue: a caller waiting
// for a reply from worker1 also reads worker2's reply, so the callback
// chained on it runs on the caller's thread (with a queue per stream,
// worker2's stream would be read by another thread). worker1's reply comes
// only after that callback ran: it releases worker1's parked call.
MULTIPROCESS_TEST(RpcTest, WaitingCallerReadsRepliesFromEveryPeer, 3) {
  init(3);
  if (mp::rank() == 0) {
    int on_caller = 0;
    for (int i = 0; i < 10; ++i) {
      if (i > 0) rpc::rpc_sync("worker1", "rearm_park");
      rpc::SyncCallScope waits_here;
      rpc::Future<int64_t> slow = rpc::rpc_async<int64_t>("worker1", "park");
      rpc::Future<int64_t> quick = rpc::rpc_async<int64_t>("worker2", "add_ints", i, 2);
      std::thread::id ran_on;
      rpc::Future<int64_t> chained = quick.then([&ran_on](const rpc::Future<int64_t>& f) {
        ran_on = std::this_thread::get_id();
        rpc::rpc_async<void>("worker1", "unpark");  // sends; does not wait
        return f.value();
      });
      EXPECT_EQ(slow.value(), 1);  // reads worker2's reply meanwhile
      EXPECT_EQ(chained.value(), i + 2);
      if (ran_on == std::this_thread::get_id()) ++on_caller;
    }
    EXPECT_GE(on_caller, 5);
  }
  rpc::shutdown();
}

// A callback run by the thread reading replies may itself wait for a call
// to the same worker: that thread reads on (nested), instead of sleeping
// while nobody else may read.
MULTIPROCESS_TEST(RpcTest, CallbackOnTheReadingThreadWaitsForAnotherCall, 2) {
  init(2);
  if (mp::rank() == 0) {
    for (int i = 0; i < 5; ++i) {
      rpc::Future<int64_t> first;
      {
        rpc::SyncCallScope waits_at_once;
        first = rpc::rpc_async<int64_t>("worker1", "add_ints", i, 1);
      }
      rpc::Future<int64_t> second = first.then([](const rpc::Future<int64_t>& f) {
        return rpc::rpc_sync<int64_t>("worker1", "add_ints", f.value(), 10);
      });
      ASSERT_TRUE(second.wait_for(absl::Seconds(20))) << "nested call " << i << " hung";
      EXPECT_EQ(second.value(), i + 11);
    }
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcTest, NestedCallsAcrossThreeWorkers, 3) {
  init(3);
  if (mp::rank() == 0) {
    // worker0 -> worker1 -> worker2 -> back.
    at::Tensor x = at::randn({8});
    EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>("worker1", "relay", "worker2", x), x + x));
    // A chain through the caller itself.
    EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>("worker2", "relay", "worker0", x), x + x));
  }
  rpc::shutdown();
}

// On worker1, bounce's thread waits for worker2 and so reads worker1's
// replies, among them worker0's answer to async_add, which completes
// async_add's future on that thread. Its reply must go out then: held back
// until bounce's wait ends, it would be what that wait waits for.
MULTIPROCESS_TEST(RpcTest, AsyncReplyCompletedWhileItsThreadWaitsGoesOut, 3) {
  init(3);
  if (mp::rank() == 0) {
    at::Tensor x = at::randn({8});
    EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>(rpc::CallOptions{kCycleTimeout}, "worker1",
                                                    "bounce", "worker2", "worker1", "worker0", x),
                          x + x));
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcTest, AsyncExecutionBatchesFourCallersOnOneThread, 5) {
  rpc::RpcBackendOptions options = mp::backend_options();
  // One worker thread on the server: a blocking implementation would
  // deadlock; async execution frees the thread after each call.
  if (mp::rank() == 0) options.num_worker_threads = 1;
  init(5, options);
  if (mp::rank() != 0) {
    for (int round = 0; round < 3; ++round) {
      at::Tensor grad = at::full({3}, static_cast<double>(mp::rank() + round));
      at::Tensor updated = rpc::rpc_sync<at::Tensor>("worker0", "update_and_fetch", grad, 4);
      // Sum over ranks 1..4 of (rank + round).
      EXPECT_TRUE(at::equal(updated, at::full({3}, 10.0 + 4 * round)));
    }
    // Only this call runs on the server's thread now.
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker0", "busy_threads"), 1);
  }
  rpc::shutdown();
}

// Waits on the network path (gRPC) that look before they sleep
// (max_spin) miss nothing: every reply and request arrives, with workers
// that spin and one that does not, and a call still ends at its timeout.
MULTIPROCESS_TEST(RpcTest, SpinningWaitsOnTheNetworkPathMissNothing, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.same_host_transport = false;
  options.max_spin = mp::rank() == 2 ? absl::ZeroDuration() : absl::Microseconds(200);
  init(3, options);
  const std::string next = mp::worker_name((mp::rank() + 1) % 3);
  for (int i = 0; i < 300; ++i) {
    at::Tensor x = at::full({i % 2 == 0 ? 4 : 16384}, static_cast<double>(i));
    ASSERT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>(next, "add", x, x), x * 2)) << i;
  }
  std::vector<rpc::Future<int64_t>> futures;
  for (int i = 0; i < 300; ++i) {
    futures.push_back(rpc::rpc_async<int64_t>(mp::worker_name(i % 3), "add_ints", i, 1));
  }
  for (int i = 0; i < 300; ++i) ASSERT_EQ(futures[i].value(), i + 1) << i;
  if (mp::rank() == 0) {
    const absl::Time start = absl::Now();
    rpc::Future<int64_t> parked =
        rpc::rpc_async<int64_t>(rpc::CallOptions{absl::Milliseconds(300)}, "worker1", "park");
    EXPECT_THROW(parked.value(), rpc::RpcError);
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    rpc::rpc_sync("worker1", "unpark");
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcTest, ThousandOutstandingCalls, 2) {
  init(2);
  if (mp::rank() == 0) {
    std::vector<rpc::Future<int64_t>> futures;
    for (int i = 0; i < 1000; ++i) {
      futures.push_back(rpc::rpc_async<int64_t>("worker1", "add_ints", i, 1));
    }
    std::vector<int64_t> values = rpc::wait_all(futures);
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(values[i], i + 1);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcTest, SixtyFourMiBTensorRoundTripIsBitExact, 2) {
  init(2);
  if (mp::rank() == 0) {
    at::Tensor big = at::randn({16 << 20});  // 64 MiB of float32
    at::Tensor back = rpc::rpc_sync<at::Tensor>("worker1", "identity", big);
    EXPECT_EQ(back.sizes(), big.sizes());
    EXPECT_EQ(std::memcmp(back.data_ptr(), big.data_ptr(), big.nbytes()), 0);
    at::Tensor ints = at::randint(1 << 30, {3, 5}, at::kLong).t();
    EXPECT_TRUE(at::equal(rpc::rpc_sync<at::Tensor>("worker1", "identity", ints), ints));
  }
  rpc::shutdown();
}

}  // namespace

namespace {

std::atomic<int> g_running{0}, g_max_running{0};
// Waits (up to 3 s) until two calls have run at once, then holds its slot
// a little longer: with N slots and more calls than N, exactly N run at once.
int64_t meet_another_call() {
  int now = ++g_running;
  int seen = g_max_running.load();
  while (now > seen && !g_max_running.compare_exchange_weak(seen, now)) {
  }
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (g_max_running.load() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(50));
  --g_running;
  return 0;
}
DDPRPC_REGISTER_FUNCTION(meet_another_call);
int64_t max_concurrency() { return g_max_running.load(); }
DDPRPC_REGISTER_FUNCTION(max_concurrency);

// Calls that one caller has in flight together run side by side: the
// caller marks them, and the callee's reader hands each on instead of
// running it itself. The callee's reader never hands reading on by itself
// here (inline_request_handoff of 10 min), so only the marks can let two
// calls meet: without them the first one would run on the reader and wait
// alone.
MULTIPROCESS_TEST(RpcTest, ConcurrentShortCallsOfOneCallerOverlap, 2) {
  rpc::RpcBackendOptions options = mp::backend_options();
  options.inline_request_handoff = absl::Minutes(10);
  init(2, options);
  if (mp::rank() == 1) {
    // In flight, holding no thread: every later call is marked.
    rpc::Future<int64_t> held = rpc::rpc_async<int64_t>("worker0", "park");
    const absl::Time start = absl::Now();
    rpc::Future<bool> a = rpc::rpc_async<bool>("worker0", "wait_for_partner", int64_t{20000});
    rpc::Future<bool> b = rpc::rpc_async<bool>("worker0", "wait_for_partner", int64_t{20000});
    EXPECT_TRUE(a.value()) << "the calls ran one at a time";
    EXPECT_TRUE(b.value());
    EXPECT_LT(absl::Now() - start, absl::Seconds(15));
    rpc::rpc_sync("worker0", "unpark");
    EXPECT_EQ(held.value(), 1);
  }
  rpc::shutdown();
}

MULTIPROCESS_TEST(RpcTest, NumWorkerThreadsBoundsConcurrentRequests, 3) {
  rpc::RpcBackendOptions options = mp::backend_options();
  if (mp::rank() == 0) options.num_worker_threads = 2;
  init(3, options);
  if (mp::rank() != 0) {
    std::vector<rpc::Future<int64_t>> futures;
    for (int i = 0; i < 4; ++i) {
      futures.push_back(rpc::rpc_async<int64_t>("worker0", "meet_another_call"));
    }
    rpc::wait_all(futures);
    // 8 calls from two callers at once, 2 slots: the bound is reached (a
    // serial callee gives 1) and never passed.
    EXPECT_EQ(rpc::rpc_sync<int64_t>("worker0", "max_concurrency"), 2);
  }
  rpc::shutdown();
}

// The stream's reader runs requests itself; one that blocks must not stop
// the caller's next request from being read (the transport's watchdog hands
// reading to the stream's other thread).
MULTIPROCESS_TEST(RpcTest, BlockedRequestDoesNotStallTheCallersNextRequest, 2) {
  init(2);
  if (mp::rank() == 1) {
    auto blocked = rpc::rpc_async<bool>("worker0", "wait_for_signal");
    rpc::rpc_sync<void>("worker0", "send_signal");
    EXPECT_TRUE(blocked.value()) << "the blocked request was not released by the next one";
  }
  rpc::shutdown();
}

// The callee reads a stream's next request only once the reply to an async
// request run on its polling thread is sent (see transport.cc), or after a
// watchdog tick or two: here that reply needs the next request.
MULTIPROCESS_TEST(RpcTest, AsyncReplyWaitingForTheCallersNextRequest, 2) {
  init(2);
  if (mp::rank() == 1) {
    for (int i = 0; i < 3; ++i) {
      auto waiting = rpc::rpc_async<bool>("worker0", "await_release");
      rpc::rpc_sync<void>("worker0", "release_awaiting");
      ASSERT_TRUE(waiting.wait_for(absl::Seconds(20))) << "round " << i;
      EXPECT_TRUE(waiting.value());
      rpc::rpc_sync<void>("worker0", "reset_awaited");
    }
  }
  rpc::shutdown();
}

// A reply that a handler completes is written when the handler returns or,
// as here, before it waits: the handler waits for what that reply's caller
// does next.
MULTIPROCESS_TEST(RpcTest, HeldReplyGoesOutBeforeTheHandlerWaits, 2) {
  init(2);
  if (mp::rank() == 1) {
    auto waiting = rpc::rpc_async<bool>("worker0", "await_release");
    auto releasing = rpc::rpc_async<bool>("worker0", "release_then_await_ack");
    ASSERT_TRUE(waiting.wait_for(absl::Seconds(20))) << "the released reply never came";
    EXPECT_TRUE(waiting.value());
    rpc::rpc_sync<void>("worker0", "ack");
    EXPECT_TRUE(releasing.value()) << "the handler waited with the reply held";
  }
  rpc::shutdown();
}

}  // namespace

namespace {

// all_gather among all workers and among a subset; barrier lets no worker
// through before every named one arrived; a missing worker is named in the
// timeout's error.
MULTIPROCESS_TEST(RpcTest, AllGatherAndBarrierAmongAllOrSomeWorkers, 3) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 3, mp::backend_options());
  rpc::Store& store = rpc::current_agent()->store();
  const auto all = rpc::all_gather("value of " + mp::worker_name());
  ASSERT_EQ(all.size(), 3u);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(all.at(mp::worker_name(r)), "value of " + mp::worker_name(r));
  if (mp::rank() != 1) {
    const auto some = rpc::all_gather(std::to_string(mp::rank() * 10), {"worker0", "worker2"});
    EXPECT_EQ(some, (std::map<std::string, std::string>{{"worker0", "0"}, {"worker2", "20"}}));
  }
  // Nobody leaves the barrier before everyone arrived at it.
  store.set("arrived/" + mp::worker_name(), "1");
  rpc::barrier();
  EXPECT_TRUE(store.check({"arrived/worker0", "arrived/worker1", "arrived/worker2"}));
  if (mp::rank() == 0) {
    try {
      rpc::barrier({"worker0", "worker1"}, absl::Milliseconds(300));  // worker1 never comes
      ADD_FAILURE() << "the barrier passed without worker1";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kTimeout);
      EXPECT_NE(std::string(e.what()).find("waiting for worker1"), std::string::npos) << e.what();
    }
    EXPECT_THROW(rpc::all_gather("x", {"worker1", "worker2"}), rpc::RpcError);  // not among them
  }
  rpc::barrier();
  rpc::shutdown();
}

}  // namespace

namespace {

// The futures of rpc_async calls made inside a WaitAllScope are waited for
// by wait() (first error thrown) or at the scope's end.
MULTIPROCESS_TEST(RpcTest, WaitAllScopeWaitsForTheCallsMadeInIt, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    rpc::Future<int64_t> outside = rpc::rpc_async<int64_t>("worker1", "add_ints", 1, 1);
    rpc::Future<int64_t> a, b;
    {
      rpc::WaitAllScope scope;
      a = rpc::rpc_async<int64_t>("worker1", "park");  // completes only on unpark
      b = rpc::rpc_async<int64_t>("worker1", "add_ints", 2, 3);
      {
        rpc::WaitAllScope inner;  // the innermost scope collects
        rpc::rpc_async<int64_t>("worker1", "add_ints", 4, 5);
        EXPECT_EQ(inner.size(), 1u);
      }
      EXPECT_EQ(scope.size(), 2u);
      rpc::rpc_sync("worker1", "unpark");  // rpc_sync: not collected
      EXPECT_EQ(scope.size(), 2u);
      scope.wait();
      EXPECT_EQ(scope.size(), 0u);
      EXPECT_TRUE(a.completed());
      EXPECT_TRUE(b.completed());
      rpc::rpc_async<int64_t>("worker1", "add_ints", "not an int", 1);  // fails
      EXPECT_THROW(scope.wait(), rpc::RpcError);
    }
    EXPECT_EQ(outside.value(), 2);
    EXPECT_EQ(a.value(), 1);
    EXPECT_EQ(b.value(), 5);
  }
  rpc::shutdown();
}

}  // namespace

namespace {

// An async result the program completes after its worker's agent is gone
// (shut down and destroyed) is dropped: nothing of the agent is touched.
MULTIPROCESS_TEST(RpcTest, AnAsyncResultCompletedAfterShutdownIsDropped, 2) {
  rpc::init_rpc(mp::worker_name(), mp::rank(), 2, mp::backend_options());
  if (mp::rank() == 0) {
    rpc::Future<int64_t> parked =
        rpc::rpc_async<int64_t>(rpc::CallOptions{absl::Milliseconds(300)}, "worker1", "park");
    EXPECT_THROW(parked.value(), rpc::RpcError);
  }
  rpc::shutdown();
  if (mp::rank() == 1) {
    // The agent is gone: the reply's sender, codecs and transport with it.
    ASSERT_FALSE(parked().completed());
    parked().set_result(int64_t{7});
    absl::SleepFor(absl::Milliseconds(200));  // a reply sent now would be on its way
  }
}

}  // namespace
