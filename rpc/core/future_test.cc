#include "rpc/core/future.h"
#include "rpc/core/internal/future_driver.h"
#include "rpc/core/internal/held_work.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace ddprpc::rpc {
namespace {

TEST(FutureTest, SetResultWakesWaiter) {
  Future<int> f;
  EXPECT_FALSE(f.completed());
  std::thread t([f] { f.set_result(42); });
  EXPECT_EQ(f.value(), 42);
  t.join();
  EXPECT_TRUE(f.completed());
  EXPECT_FALSE(f.has_error());
}

TEST(FutureTest, ErrorIsRethrownWithCode) {
  Future<int> f;
  f.set_error(RpcError(ErrorCode::kTimeout, "too slow"));
  EXPECT_TRUE(f.has_error());
  EXPECT_EQ(f.error_message(), "too slow");
  try {
    f.value();
    FAIL() << "value() did not throw";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
}

TEST(FutureTest, CompletingTwiceThrows) {
  Future<int> f;
  f.set_result(1);
  EXPECT_THROW(f.set_result(2), std::logic_error);
  EXPECT_EQ(f.value(), 1);
}

TEST(FutureTest, TrySetResultCompletesOnlyOnce) {
  Future<void> f;
  int calls = 0;
  f.add_done_callback([&](const Future<void>&) { ++calls; });
  EXPECT_TRUE(f.try_set_result());
  EXPECT_FALSE(f.try_set_result());
  EXPECT_EQ(calls, 1);
  EXPECT_THROW(f.set_result(), std::logic_error);  // set_result still insists on once
  Future<void> failed;
  failed.set_error(RpcError(ErrorCode::kTimeout, "late"));
  EXPECT_FALSE(failed.try_set_result());
  EXPECT_NE(failed.error(), nullptr);  // the error stays
}

TEST(FutureTest, CallbacksRunOnceBeforeAndAfterCompletion) {
  Future<int> f;
  int before = 0, after = 0;
  f.add_done_callback([&](const Future<int>& g) { before += g.value(); });
  f.set_result(5);
  f.add_done_callback([&](const Future<int>& g) { after += g.value(); });
  EXPECT_EQ(before, 5);
  EXPECT_EQ(after, 5);
}

TEST(FutureTest, ThenChainsValuesAndErrors) {
  Future<int> f;
  Future<std::string> g = f.then([](const Future<int>& x) { return std::to_string(x.value() * 2); });
  Future<int> h = g.then([](const Future<std::string>& s) -> int {
    throw std::runtime_error("bad " + s.value());
  });
  f.set_result(21);
  EXPECT_EQ(g.value(), "42");
  EXPECT_EQ(h.error_message(), "bad 42");
}

TEST(FutureTest, ThenFlattensReturnedFuture) {
  Future<int> f;
  Future<int> inner;
  Future<int> g = f.then([inner](const Future<int>&) { return inner; });
  f.set_result(1);
  EXPECT_FALSE(g.completed());
  inner.set_result(7);
  EXPECT_EQ(g.value(), 7);
}

TEST(FutureTest, VoidFuture) {
  Future<void> f;
  Future<int> g = f.then([](const Future<void>& v) {
    v.wait();
    return 3;
  });
  f.set_result();
  EXPECT_EQ(g.value(), 3);
}

TEST(FutureTest, WaitForTimesOut) {
  Future<int> f;
  EXPECT_FALSE(f.wait_for(absl::Milliseconds(20)));
  f.set_result(1);
  EXPECT_TRUE(f.wait_for(absl::Milliseconds(20)));
}

TEST(FutureTest, CollectAllAndWaitAll) {
  std::vector<Future<int>> fs(3);
  auto all = collect_all(fs);
  fs[0].set_result(1);
  fs[2].set_result(3);
  EXPECT_FALSE(all.completed());
  fs[1].set_error(RpcError(ErrorCode::kInternal, "x"));
  ASSERT_TRUE(all.completed());
  EXPECT_EQ(all.value().size(), 3u);
  EXPECT_TRUE(all.value()[1].has_error());
  EXPECT_THROW(wait_all(fs), RpcError);

  std::vector<Future<int>> ok = {make_ready_future(1), make_ready_future(2)};
  EXPECT_EQ(wait_all(ok), (std::vector<int>{1, 2}));
}

// wait() runs the driver on the waiting thread before sleeping; a future
// chained with then() runs its parent's; completion drops the driver.
TEST(FutureTest, WaitRunsTheDriverAndThenInheritsIt) {
  Future<int> f;
  int calls = 0;
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> alive = token;
  f.set_driver(std::make_shared<const internal::FutureDriver>(internal::FutureDriver{
      [f, &calls, token](const std::function<bool()>& done, absl::Time) {
        ++calls;
        EXPECT_FALSE(done());
        f.set_result(7);  // the waiter made the progress itself
        EXPECT_TRUE(done());
      }}));
  token.reset();
  Future<int> doubled = f.then([](const Future<int>& g) { return 2 * g.value(); });
  EXPECT_EQ(doubled.value(), 14);  // drives f, whose callback completes doubled
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(f.value(), 7);  // completed: no second drive
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(f.driver(), nullptr);
  EXPECT_EQ(doubled.driver(), nullptr);
  EXPECT_TRUE(alive.expired()) << "completion must release the driver";
}

// A driver that stops before completion leaves wait() sleeping for another
// thread to complete the future.
TEST(FutureTest, WaitSleepsWhenTheDriverGivesUp) {
  Future<int> f;
  f.set_driver(std::make_shared<const internal::FutureDriver>(internal::FutureDriver{
      [](const std::function<bool()>&, absl::Time) {}}));
  std::thread t([f] {
    absl::SleepFor(absl::Milliseconds(20));
    f.set_result(3);
  });
  EXPECT_EQ(f.value(), 3);
  t.join();
}

// wait_for() drives too, bounded by its own timeout.
TEST(FutureTest, WaitForRunsTheDriverUntilItsTimeout) {
  Future<int> f;
  absl::Time until_seen;
  f.set_driver(std::make_shared<const internal::FutureDriver>(internal::FutureDriver{
      [&until_seen](const std::function<bool()>& done, absl::Time until) {
        until_seen = until;
        EXPECT_FALSE(done());
      }}));
  const absl::Time before = absl::Now();
  EXPECT_FALSE(f.wait_for(absl::Milliseconds(30)));
  EXPECT_GE(until_seen, before + absl::Milliseconds(30));
  EXPECT_LE(until_seen, absl::Now());
}

TEST(FutureTest, HeldWorkRunsWhenItsScopeEndsOrBeforeAWait) {
  std::vector<int> order;
  {
    internal::HeldWork held;
    EXPECT_EQ(internal::HeldWork::current(), &held);
    held.add([&] { order.push_back(1); });
    Future<int> done = make_ready_future(3);
    EXPECT_EQ(done.value(), 3);  // completed: nothing to wait for, nothing run
    EXPECT_TRUE(order.empty());
    Future<int> pending;
    EXPECT_FALSE(pending.wait_for(absl::Milliseconds(1)));  // about to wait: runs it
    EXPECT_EQ(order, std::vector<int>({1}));
    held.add([&] { order.push_back(2); });
  }
  EXPECT_EQ(order, std::vector<int>({1, 2}));
  EXPECT_EQ(internal::HeldWork::current(), nullptr);
}

TEST(FutureTest, WaitAllThrowsTheFirstErrorWithoutWaitingForTheRest) {
  std::vector<Future<int>> fs(3);  // fs[2] never completes
  fs[0].set_result(1);
  std::thread fail([f = fs[1]] {
    absl::SleepFor(absl::Milliseconds(10));
    f.set_error(RpcError(ErrorCode::kInternal, "second call failed"));
  });
  const absl::Time start = absl::Now();
  try {
    wait_all(fs);
    ADD_FAILURE() << "wait_all returned although a future failed";
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("second call failed"), std::string::npos) << e.what();
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(fs[2].completed());
  fail.join();
  // An error that is already there is thrown at once too.
  EXPECT_THROW(wait_all(fs), RpcError);
  std::vector<Future<int>> empty;
  EXPECT_TRUE(wait_all(empty).empty());
}

TEST(FutureTest, SendCompletedRepliesRunsWhatTheHandlerHoldsNow) {
  std::vector<int> order;
  send_completed_replies();  // outside a handler: nothing to send
  {
    internal::HeldWork held;
    held.add([&] { order.push_back(1); });
    held.add([&] { order.push_back(2); });
    send_completed_replies();
    EXPECT_EQ(order, std::vector<int>({1, 2}));
    held.add([&] { order.push_back(3); });
  }
  EXPECT_EQ(order, std::vector<int>({1, 2, 3}));
}

// A future chained with then() has completed by the time wait_all on the
// future it came from returns, even when wait_all starts while the
// completing thread still runs then()'s callback (as WaitAllScope::wait
// waits on the calls' raw futures, whose typed futures hang off them).
TEST(FutureTest, ThenFuturesHaveCompletedWhenWaitAllOnTheirSourceReturns) {
  Future<int> raw;
  absl::Notification in_callback;
  Future<int> typed = raw.then([&](const Future<int>& f) {
    in_callback.Notify();
    absl::SleepFor(absl::Milliseconds(100));  // a slow conversion
    return f.value() * 2;
  });
  std::thread completer([&] { raw.set_result(21); });
  in_callback.WaitForNotification();
  ASSERT_TRUE(raw.completed());
  wait_all(std::vector<Future<int>>{raw});
  EXPECT_TRUE(typed.completed()) << "wait_all returned before then()'s future completed";
  EXPECT_EQ(typed.value(), 42);
  completer.join();
  // A callback that adds another to its own future runs it at once.
  Future<int> self;
  bool inner_ran = false;
  self.add_done_callback([&](const Future<int>& f) {
    f.add_done_callback([&](const Future<int>&) { inner_ran = true; });
    EXPECT_TRUE(inner_ran);
  });
  self.set_result(1);
  EXPECT_TRUE(inner_ran);
}

}  // namespace
}  // namespace ddprpc::rpc
