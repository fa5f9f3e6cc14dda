#include "rpc/store.h"

#include <thread>

#include "gtest/gtest.h"
#include "rpc/errors.h"

namespace ddprpc::rpc {
namespace {

TEST(StoreTest, SetGetAddWaitAcrossThreads) {
  auto server = StoreServer::start("127.0.0.1", 0);
  Store a("127.0.0.1", server->port(), absl::Seconds(10));
  Store b("127.0.0.1", server->port(), absl::Seconds(10));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    a.set("k", "v");
  });
  EXPECT_EQ(b.get("k"), "v");  // blocks until set
  setter.join();
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

}  // namespace
}  // namespace ddprpc::rpc
