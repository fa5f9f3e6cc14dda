#include "rpc/future.h"

#include <thread>

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

}  // namespace
}  // namespace ddprpc::rpc
