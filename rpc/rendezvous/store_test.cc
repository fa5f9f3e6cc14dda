#include "rpc/rendezvous/store.h"

#include <atomic>
#include <string>
#include <thread>

#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/errors.h"
#include "rpc/rendezvous/internal/store_state.h"

namespace ddprpc::rpc {
namespace {

TEST(StoreTest, SetGetAddWaitAcrossThreads) {
  auto server = StoreServer::start("127.0.0.1", 0);
  Store a("127.0.0.1", server->port(), absl::Seconds(10));
  Store b("127.0.0.1", server->port(), absl::Seconds(10));
  // get() blocks until the key is set, then returns its value.
  std::atomic<bool> got{false};
  std::string value;
  std::thread getter([&] {
    value = b.get("k");
    got = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(got.load()) << "get returned before the key was set";
  a.set("k", "v");
  getter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(value, "v");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 3), 5);
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(a.check({"k", "missing"}));
  b.wait({"k", "n"}, absl::Seconds(1));
}

TEST(StoreTest, MissingKeyTimesOut) {
  auto server = StoreServer::start("127.0.0.1", 0);
  Store s("127.0.0.1", server->port(), absl::Milliseconds(200));
  absl::Time start = absl::Now();
  try {
    s.get("never");
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos);
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(StoreTest, UnreachableServerFailsFast) {
  auto server = StoreServer::start("127.0.0.1", 0);
  int port = server->port();
  server.reset();
  Store s("127.0.0.1", port, absl::Seconds(30));
  s.set_fail_fast(true);
  absl::Time start = absl::Now();
  EXPECT_THROW(s.set("k", "v"), RpcError);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(StoreTest, PortInUseIsAClearError) {
  auto server = StoreServer::start("127.0.0.1", 0);
  try {
    StoreServer::start("127.0.0.1", server->port());
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen"), std::string::npos);
  }
}

// What one client can make the store hold, or wait on, is bounded.
TEST(StoreStateTest, KeysBytesAndWaitersAreBounded) {
  using internal::StoreState;
  StoreState state;
  rendezvous::StoreRequest req;
  rendezvous::StoreResponse resp;
  for (size_t i = 0; i < StoreState::kMaxKeys; ++i) {
    req.set_key(absl::StrCat(i));
    ASSERT_TRUE(state.set(req, &resp).ok()) << i;
  }
  req.set_key("one more");
  EXPECT_EQ(state.set(req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  req.set_key("0");  // overwriting an existing key is fine
  EXPECT_TRUE(state.set(req, &resp).ok());

  // Integers that would overflow.
  req.set_key("n");
  req.set_amount(int64_t{1} << 62);
  StoreState counters;
  EXPECT_TRUE(counters.add(req, &resp).ok());
  EXPECT_TRUE(counters.add(req, &resp).ok() == false);

  // max_waiters requests block; the next is refused at once.
  constexpr int kWaiters = 16;
  StoreState waits(kWaiters);
  rendezvous::StoreRequest wait;
  wait.add_keys("never");
  wait.set_timeout_ms(600000);  // stop() ends them
  std::vector<std::thread> waiters;
  std::atomic<int> unavailable{0};
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&] {
      rendezvous::StoreResponse r;
      if (waits.wait(wait, &r, [] { return false; }).error_code() == grpc::StatusCode::UNAVAILABLE) {
        ++unavailable;
      }
    });
  }
  grpc::Status refused;
  const absl::Time until = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(10));
    refused = waits.wait(wait, &resp, [] { return false; });
  } while (refused.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED && absl::Now() < until);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  waits.stop();  // wakes them all
  for (auto& t : waiters) t.join();
  EXPECT_EQ(unavailable.load(), kWaiters);
}

}  // namespace
}  // namespace ddprpc::rpc
